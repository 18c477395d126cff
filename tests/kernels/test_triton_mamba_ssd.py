"""The Triton Mamba-2 SSD kernels (chunked scan, decode update, verify) against the float64 per-token oracle of
mamba_ssd_cases on fresh random inputs: mixed batches of prefill / continuation / decode rows, lengths that are
not multiples of the chunk, G < H, initial states on and off, strided views of a fused projection, candidate
slots. Pool slots the batch does not own hold NaN and must stay untouched; so do the slots of fresh sequences,
so reading one would poison the output. Runs on a GPU, or on a CPU through Triton's interpreter (tiny shapes;
the chunked scan in fp32 / fp16 only there: Triton 3.6's interpreter computes bf16 dots on raw bits)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import CUDA, DEV, TOL
from mamba_ssd_cases import make_batch, oracle_varlen, rel

from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.metadata import StateMetadata

CHUNK_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ids = lambda d: str(d)[6:]  # noqa: E731


def _dev(bt, strided=False):
    """The batch's inputs on DEV; strided: x, B, C, dt as views of one fused [T, width] buffer, as the layer's
    in_proj / conv1d output hands them over."""
    t, h, p = bt.x.shape
    g, n = bt.B.shape[1:]
    if not strided:
        return tuple(u.to(DEV) for u in (bt.x, bt.dt, bt.B, bt.C))
    width = h * p + 2 * g * n + h + 8
    buf = torch.zeros(t, width, dtype=bt.x.dtype)
    parts = [bt.x.reshape(t, -1), bt.B.reshape(t, -1), bt.C.reshape(t, -1), bt.dt]
    o = 0
    for u in parts:
        buf[:, o:o + u.shape[1]] = u
        o += u.shape[1]
    buf = buf.to(DEV)
    x = buf[:, :h * p].unflatten(1, (h, p))
    B = buf[:, h * p:h * p + g * n].unflatten(1, (g, n))
    C = buf[:, h * p + g * n:h * p + 2 * g * n].unflatten(1, (g, n))
    dt = buf[:, h * p + 2 * g * n:h * p + 2 * g * n + h]
    assert not x.is_contiguous() and dt.stride(0) == width
    return x, dt, B, C


def _params(bt):
    return tuple(u.to(DEV) for u in (bt.A_log, bt.D, bt.dt_bias))


def _check_pool(pool, want_pool, tol):
    got = pool.cpu()
    nan = want_pool.isnan()
    assert torch.equal(got.isnan(), nan), "a slot outside the batch was written (or a live one left NaN)"
    assert rel(got[~nan], want_pool[~nan]) < tol


@pytest.mark.parametrize("dtype", CHUNK_DTYPES, ids=ids)
@pytest.mark.parametrize("lens,groups,bt", [
    # with a bt, each output program takes all the heads of a group (out_heads = H / G)
    ([1, 40, 1, 1, 9, 2], 2, 16),  # mixed decode / prefill rows
    ([33, 64], 1, 16),  # chunk-aligned and not
    ([100], 4, 32),  # one prompt, G == H
    ([0, 5, 1, 0], 2, 16),  # empty sequences (padding rows of a captured batch)
    ([70, 3], 2, None),  # the default tiles (BT = 64): one row past a chunk, and a short one
])
def test_chunked_matches_oracle(lens, groups, bt, dtype):
    from lamina.kernels.triton_mamba_ssd_chunk import ssd_chunked_triton

    b = make_batch(lens, heads=4, head_dim=8, groups=groups, dstate=16, dtype=dtype, seed=sum(lens) + (bt or 0))
    want, want_pool = oracle_varlen(b)
    x, dt, B, C = _dev(b)
    A_log, D, dt_bias = _params(b)
    pool = b.pool.to(DEV)
    y = ssd_chunked_triton(x, dt, A_log, B, C, D, dt_bias, pool, torch.tensor(b.query_start, dtype=torch.int32,
                           device=DEV), torch.tensor(b.slots, device=DEV), torch.tensor(b.init, device=DEV),
                           tune=None if bt is None else {"bt": bt, "out_heads": 4 // groups})
    assert y.dtype == dtype and y.shape == x.shape
    assert rel(y, want) < TOL[dtype]
    _check_pool(pool, want_pool, TOL[dtype])


@pytest.mark.parametrize("dtype", CHUNK_DTYPES, ids=ids)
def test_chunked_state_rows_split(dtype):
    """The state pass with its [P, N] tile split along N too (the lone-long-prompt tiles)."""
    from lamina.kernels.triton_mamba_ssd_chunk import ssd_chunked_triton

    b = make_batch([45, 2], heads=2, head_dim=8, groups=1, dstate=64, dtype=dtype, seed=8, init=[True, False])
    want, want_pool = oracle_varlen(b)
    x, dt, B, C = _dev(b)
    A_log, D, dt_bias = _params(b)
    pool = b.pool.to(DEV)
    y = ssd_chunked_triton(x, dt, A_log, B, C, D, dt_bias, pool, torch.tensor(b.query_start, dtype=torch.int32,
                           device=DEV), torch.tensor(b.slots, device=DEV), torch.tensor(b.init, device=DEV),
                           tune={"bt": 32, "state_bn": 16 if dtype == torch.float32 else 32})
    assert rel(y, want) < TOL[dtype]
    _check_pool(pool, want_pool, TOL[dtype])


@pytest.mark.parametrize("dtype", CHUNK_DTYPES, ids=ids)
def test_chunked_strided_views_clamp_and_no_pool(dtype):
    from lamina.kernels.triton_mamba_ssd_chunk import ssd_chunked_triton

    lens = [20, 1, 47]
    b = make_batch(lens, heads=4, head_dim=16, groups=2, dstate=8, dtype=dtype, seed=4, init=[True, True, False])
    want, want_pool = oracle_varlen(b, dt_min=0.01, dt_max=0.08)
    x, dt, B, C = _dev(b, strided=True)
    A_log, D, dt_bias = _params(b)
    qs = torch.tensor(b.query_start, dtype=torch.int32, device=DEV)
    pool = b.pool.to(DEV)
    y = ssd_chunked_triton(x, dt, A_log, B, C, D, dt_bias, pool, qs, torch.tensor(b.slots, device=DEV),
                           torch.tensor(b.init, device=DEV), 0.01, 0.08, tune={"bt": 16})
    assert rel(y, want) < TOL[dtype]
    _check_pool(pool, want_pool, TOL[dtype])
    # no pool (a profiling pass): zero states, nothing written
    b.init = [False] * 3
    want, _ = oracle_varlen(b)
    y = ssd_chunked_triton(x, dt, A_log, B, C, D, dt_bias, None, qs, None, None, tune={"bt": 32})
    assert rel(y, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
@pytest.mark.parametrize("groups,block_p", [(1, None), (2, 4), (4, None)])
def test_decode_matches_oracle(groups, block_p, dtype):
    from lamina.kernels.triton_mamba_ssd_decode import ssd_decode_triton

    lens = [1] * 5
    b = make_batch(lens, heads=4, head_dim=8, groups=groups, dstate=16, dtype=dtype, seed=groups,
                   init=[True, False, True, True, False])
    want, want_pool = oracle_varlen(b)
    x, dt, B, C = _dev(b, strided=groups == 2)
    A_log, D, dt_bias = _params(b)
    pool = b.pool.to(DEV)
    out = torch.full(x.shape, float("nan"), dtype=dtype, device=DEV)
    ssd_decode_triton(x, dt, A_log, B, C, D, dt_bias, pool, torch.tensor(b.slots, device=DEV),
                      torch.tensor(b.init, device=DEV), out=out, block_p=block_p)
    assert rel(out, want) < TOL[dtype]
    _check_pool(pool, want_pool, 1e-5)  # the state itself is fp32 math from the same rounded inputs


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ids)
@pytest.mark.parametrize("lens", [[3, 1, 4], [1, 1], [5]])
def test_verify_matches_oracle(lens, dtype):
    from lamina.kernels.triton_mamba_ssd import mamba_ssd_verify_triton

    bsz, max_len = len(lens), max(lens)
    b = make_batch(lens, heads=4, head_dim=8, groups=2, dstate=16, dtype=dtype, seed=sum(lens),
                   init=[i % 2 == 0 for i in range(bsz)], extra_slots=sum(lens))
    free = [s for s in range(b.pool.shape[0]) if s not in b.slots]
    cand_lists, cands = [], torch.zeros(bsz, max(1, max_len - 1), dtype=torch.int64)
    for i, n in enumerate(lens):
        cand_lists.append([free.pop() for _ in range(n - 1)])
        cands[i, :n - 1] = torch.tensor(cand_lists[-1], dtype=torch.int64)
    want, want_pool = oracle_varlen(b, candidates=cand_lists)
    x, dt, B, C = _dev(b)
    A_log, D, dt_bias = _params(b)
    pool = b.pool.to(DEV)
    y = mamba_ssd_verify_triton(x, dt, A_log, B, C, D, dt_bias, pool,
                                torch.tensor(b.query_start, dtype=torch.int32, device=DEV),
                                torch.tensor(b.slots, device=DEV), cands.to(DEV), torch.tensor(b.init, device=DEV),
                                max_len)
    assert rel(y, want) < TOL[dtype]
    _check_pool(pool, want_pool, 1e-5)


def _meta(b):
    qs = b.query_start
    lens = [qs[i + 1] - qs[i] for i in range(len(b.slots))]
    attn = AttentionMetadata(torch.full((qs[-1],), -1, dtype=torch.long, device=DEV),
                             torch.tensor(qs, dtype=torch.int32, device=DEV),
                             torch.tensor(lens, dtype=torch.int32, device=DEV),
                             torch.zeros(len(lens), 1, dtype=torch.int32, device=DEV), qs, lens, max(lens), max(lens))
    state = StateMetadata(torch.tensor(b.slots, device=DEV), torch.tensor(b.init, device=DEV), b.slots, b.init)
    return attn, state


@pytest.mark.parametrize("lens", [[1, 1, 1], [1, 30, 1, 2]], ids=["decode", "mixed"])
def test_step_dispatch_on_metadata(lens):
    """The per-step entry on engine metadata: decode-only steps take the update kernel, others the chunked scan;
    state None (a profiling pass) writes nothing."""
    from lamina.kernels.triton_mamba_ssd import mamba_ssd_varlen_triton

    b = make_batch(lens, heads=4, head_dim=8, groups=2, dstate=16, dtype=torch.float32, seed=len(lens))
    want, want_pool = oracle_varlen(b)
    x, dt, B, C = _dev(b)
    A_log, D, dt_bias = _params(b)
    attn, state = _meta(b)
    pool = b.pool.to(DEV)
    y = mamba_ssd_varlen_triton(x, dt, A_log, B, C, D, dt_bias, pool, attn, state)
    assert rel(y, want) < TOL[torch.float32]
    _check_pool(pool, want_pool, 1e-4)
    pool = b.pool.to(DEV)
    y = mamba_ssd_varlen_triton(x, dt, A_log, B, C, D, dt_bias, pool, attn, None)
    assert torch.isfinite(y).all()
    assert torch.equal(pool.cpu().nan_to_num(7.0), b.pool.nan_to_num(7.0))


@pytest.mark.parametrize("with_device_candidates", [True, False], ids=["verify_kernel", "host_candidates"])
def test_public_entry_on_verify_metadata(with_device_candidates):
    """mamba_ssd_varlen on a verify step's metadata (on a GPU: the verify kernel when the device candidate table
    is there, else the reference; on a CPU: the reference) keeps the state after every draft position."""
    from lamina.kernels.mamba_ssd import mamba_ssd_varlen

    lens = [3, 1, 2]
    b = make_batch(lens, heads=4, head_dim=8, groups=2, dstate=16, dtype=torch.float32, seed=13,
                   init=[True, False, True], extra_slots=6)
    free = [s for s in range(b.pool.shape[0]) if s not in b.slots]
    cand_lists = [free[:2], [], free[2:3]]
    cands = torch.tensor([[free[0], free[1]], [0, 0], [free[2], 0]], dtype=torch.int64, device=DEV)
    want, want_pool = oracle_varlen(b, candidates=cand_lists)
    x, dt, B, C = _dev(b)
    A_log, D, dt_bias = _params(b)
    attn, state = _meta(b)
    state = StateMetadata(state.slots, state.has_initial_state, b.slots, b.init, cand_lists,
                          cands if with_device_candidates else None)
    pool = b.pool.to(DEV)
    y = mamba_ssd_varlen(x, dt, A_log, B, C, D, dt_bias, pool, attn, state)
    assert rel(y, want) < TOL[torch.float32]
    _check_pool(pool, want_pool, 1e-5)


def test_output_heads_keeps_the_grid_full():
    from lamina.kernels.triton_mamba_ssd_chunk import output_heads

    assert output_heads(128, 8, 257) == 16  # a 16k-token prompt: C B^T once per group
    assert output_heads(128, 8, 17) == 2  # a 1k-token prompt: 17 x 64 programs
    assert output_heads(128, 8, 5) == 1
    assert output_heads(24, 2, 1000) == 12 and output_heads(24, 2, 200) == 4  # divisors of H / G only


@pytest.mark.parametrize("dtype", CHUNK_DTYPES, ids=ids)
def test_split_verify_with_prefill_rows(dtype):
    """A step where some sequences verify drafts while others prefill (no device candidate table): the verify
    kernel on the verifying sequences, the chunked scan on the rest, results scattered back in row order."""
    from lamina.kernels.triton_mamba_ssd import mamba_ssd_split_verify_triton

    lens = [3, 40, 1, 4]
    b = make_batch(lens, heads=4, head_dim=8, groups=2, dstate=16, dtype=dtype, seed=17,
                   init=[True, False, True, True], extra_slots=6)
    free = [s for s in range(b.pool.shape[0]) if s not in b.slots]
    cand_lists = [free[:2], [], [], free[2:5]]
    want, want_pool = oracle_varlen(b, candidates=cand_lists)
    x, dt, B, C = _dev(b, strided=True)
    A_log, D, dt_bias = _params(b)
    attn, state = _meta(b)
    state = StateMetadata(state.slots, state.has_initial_state, b.slots, b.init, cand_lists, None)
    pool = b.pool.to(DEV)
    y = mamba_ssd_split_verify_triton(x, dt, A_log, B, C, D, dt_bias, pool, attn, state)
    assert y.dtype == dtype and rel(y, want) < TOL[dtype]
    _check_pool(pool, want_pool, TOL[dtype])
