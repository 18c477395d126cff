"""Gated DeltaNet Triton kernels (varlen causal conv1d, recurrent decode step) against their torch references.

Runs on a CUDA machine; on a CPU only under TRITON_INTERPRET=1 (tiny shapes, fp32/fp16; bf16 only on CUDA).
State pools are poisoned with NaN in every slot the step must not read (fresh sequences, slots outside
the batch); outputs are NaN-poisoned so every row must be written. Oracles run the references on fp32
copies; written states are compared exactly (conv: copies of inputs) or to fp32 rounding (recurrent).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import CUDA, DEV, TOL, rel_err

from lamina.kernels.conv1d import causal_conv1d_varlen_ref
from lamina.kernels.gated_delta import recurrent_gated_delta_rule_ref

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def dt_id(d: torch.dtype) -> str:
    return str(d)[6:]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN in the same places."""
    a, b = a.cpu(), b.cpu()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


def strided_rows(gen: torch.Generator, rows: int, cols: int, dtype: torch.dtype, pad: int = 24) -> torch.Tensor:
    """[rows, cols] as a column slice of a wider buffer (stride(0) > cols), like a split projection output."""
    buf = torch.randn(rows, cols + pad, generator=gen).to(dtype).to(DEV)
    return buf[:, pad // 2: pad // 2 + cols]


def make_pool(gen: torch.Generator, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype,
              slots: list[int], init: list[bool]) -> torch.Tensor:
    """Random live states in the slots of continuing sequences, NaN everywhere else."""
    pool = torch.full((num_slots, *shape), float("nan"), dtype=dtype)
    for s, live in zip(slots, init):
        if live:
            pool[s] = torch.randn(shape, generator=gen).to(dtype)
    return pool.to(DEV)


# ---------------------------------------------------------------------------------------------- conv1d

# name: (chunk lengths, has_initial_state, channels, kernel width, bias, tile overrides (block_t, block_c))
CONV_CASES = {
    # chunks longer than BLOCK_T (several token blocks), shorter than K-1, length 1; fresh and continuing
    "mixed_multiblock": ([11, 2, 1, 5, 3], [True, True, False, False, True], 40, 4, True, (4, 16)),
    "mixed_default_tiles": ([11, 2, 1, 5], [False, True, True, True], 40, 4, False, (None, None)),
    "long_two_blocks": ([45, 1], [True, True], 24, 4, True, (None, None)),  # BLOCK_T 32: two token blocks
    "decode": ([1, 1, 1, 1, 1], [True, False, True, True, False], 72, 4, True, (None, 32)),
    "decode_nobias_k3": ([1, 1, 1], [True, True, False], 40, 3, False, (None, None)),
    "prefill_fresh_k2": ([6, 9], [False, False], 16, 2, True, (4, None)),
    "k5_block_t_eq_k_minus_1": ([10, 3, 1], [True, True, False], 24, 5, True, (4, 16)),
}


def run_conv_case(lens, init, c, k, has_bias, tiles, dtype, seed, use_pool=True, max_query_len=None):
    from lamina.kernels.triton_conv1d import causal_conv1d_varlen_triton

    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    qs = [0]
    for n in lens:
        qs.append(qs[-1] + n)
    num_slots = b + 3
    slots = torch.randperm(num_slots, generator=gen)[:b].tolist()
    x = strided_rows(gen, qs[-1], c, dtype)
    w = (0.5 * torch.randn(c, k, generator=gen)).to(dtype).to(DEV)
    bias = torch.randn(c, generator=gen).to(dtype).to(DEV) if has_bias else None
    pool = make_pool(gen, num_slots, (c, k - 1), dtype, slots, init) if use_pool else None
    pool_ref = pool.float().clone() if use_pool else None
    oracle = causal_conv1d_varlen_ref(x.float(), w.float(), None if bias is None else bias.float(), pool_ref, qs,
                                      slots if use_pool else None, init)
    out = torch.full((qs[-1], c), float("nan"), dtype=dtype, device=DEV)
    res = causal_conv1d_varlen_triton(
        x, w, bias, pool, torch.tensor(qs, dtype=torch.int32, device=DEV),
        torch.tensor(slots, device=DEV) if use_pool else None, torch.tensor(init, device=DEV),
        max_query_len or max(lens), "silu", out=out, block_t=tiles[0], block_c=tiles[1])
    assert res.data_ptr() == out.data_ptr()
    assert rel_err(out, oracle) < TOL[dtype], rel_err(out, oracle)
    if use_pool:
        # New states are copies of inputs: exact. Slots outside the batch (NaN) must be untouched.
        assert same(pool.float(), pool_ref)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv1d_varlen(case, dtype):
    lens, init, c, k, has_bias, tiles = CONV_CASES[case]
    run_conv_case(lens, init, c, k, has_bias, tiles, dtype, seed=len(case))


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=dt_id)
@pytest.mark.parametrize("tiles", [(None, None), (4, 16)])
def test_conv1d_graph_padded_batch(dtype, tiles):
    # A CUDA graph's batch: max_query_len is the padded token count (not the longest chunk); decode rows, a
    # chunk, the padding sequence owning the tail rows (fresh), then empty slots. Empty slots write nothing.
    lens = [1, 1, 37, 1, 5, 3, 0, 0, 0]
    init = [True, True, False, True, True, False, True, False, True]
    run_conv_case(lens, init, 40, 4, True, tiles, dtype, seed=21, max_query_len=64)
    run_conv_case([0, 16, 0], [True, True, False], 24, 4, False, tiles, dtype, seed=22, max_query_len=16)


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=dt_id)
def test_conv1d_without_pool(dtype):
    # No pool (profiling pass): zero states, nothing written; also has_initial_state None with a pool.
    from lamina.kernels.triton_conv1d import causal_conv1d_varlen_triton

    run_conv_case([7, 1, 3], [True, True, True], 40, 4, True, (4, 16), dtype, seed=3, use_pool=False)
    gen = torch.Generator().manual_seed(5)
    x = strided_rows(gen, 9, 24, dtype)
    w = torch.randn(24, 4, generator=gen).to(dtype).to(DEV)
    pool = torch.full((3, 24, 3), float("nan"), dtype=dtype, device=DEV)
    pool_ref = torch.zeros(3, 24, 3)
    qs = [0, 4, 9]
    oracle = causal_conv1d_varlen_ref(x.float().cpu(), w.float().cpu(), None, pool_ref, qs, [2, 0], [False, False])
    out = causal_conv1d_varlen_triton(x, w, None, pool, torch.tensor(qs, dtype=torch.int32, device=DEV),
                                      torch.tensor([2, 0], device=DEV), None, 5)
    assert rel_err(out, oracle) < TOL[dtype]
    assert same(pool[[0, 2]].float().cpu(), pool_ref[[0, 2]]) and pool[1].isnan().all()


def test_conv1d_chunked_prefill_then_decode():
    # The same sequence fed as chunks 6, 2, 1, 1 through the kernel equals one pass over all of it.
    from lamina.kernels.triton_conv1d import causal_conv1d_varlen_triton

    gen = torch.Generator().manual_seed(11)
    c, k = 40, 4
    x = strided_rows(gen, 10, c, torch.float32)
    w, bias = torch.randn(c, k, generator=gen).to(DEV), torch.randn(c, generator=gen).to(DEV)
    pool = torch.full((2, c, k - 1), float("nan"), device=DEV)
    slot = torch.tensor([1], device=DEV)
    outs, pos = [], 0
    for n in (6, 2, 1, 1):
        outs.append(causal_conv1d_varlen_triton(
            x[pos:pos + n], w, bias, pool, torch.tensor([0, n], dtype=torch.int32, device=DEV), slot,
            torch.tensor([pos > 0], device=DEV), n, block_t=4, block_c=16))
        pos += n
    whole = causal_conv1d_varlen_ref(x, w, bias, torch.zeros(2, c, k - 1, device=DEV), [0, 10], [1], [False])
    assert rel_err(torch.cat(outs), whole) < 1e-5
    assert torch.equal(pool[1], x[-(k - 1):].t()) and pool[0].isnan().all()


# ---------------------------------------------------------------------------------------------- decode

# name: (batch, Hk, Hv, dk, dv, has_initial_state, use_qk_l2norm, block_v override)
DECODE_CASES = {
    "grouped_multi_vblock": (3, 2, 4, 16, 32, [True, False, True], True, 16),
    "grouped_default_tiles": (4, 1, 2, 32, 32, [True, True, False, True], True, None),
    "d64": (2, 2, 2, 64, 64, [True, False], True, None),
    "odd_dims_masked": (2, 1, 2, 24, 40, [True, True], True, 16),
    "no_l2norm": (2, 2, 2, 16, 16, [True, False], False, None),
}


def run_decode_case(bsz, hk, hv, dk, dv, init, l2, block_v, dtype, seed, use_pool=True):
    from lamina.kernels.triton_gdn_decode import gated_delta_decode_triton

    gen = torch.Generator().manual_seed(seed)
    num_slots = bsz + 3
    slots = torch.randperm(num_slots, generator=gen)[:bsz].tolist()
    # q | k | v as views of one conv output row, a and b as views of a projection row (all strided).
    qkv = strided_rows(gen, bsz, 2 * hk * dk + hv * dv, dtype)
    q = qkv[:, : hk * dk].view(bsz, hk, dk)
    k = qkv[:, hk * dk: 2 * hk * dk].view(bsz, hk, dk)
    v = qkv[:, 2 * hk * dk:].view(bsz, hv, dv)
    ba = strided_rows(gen, bsz, 2 * hv, dtype)
    b_raw, a_raw = ba[:, :hv], ba[:, hv:]
    a_log = (0.5 * torch.randn(hv, generator=gen)).to(DEV)
    dt_bias = torch.randn(hv, generator=gen).to(dtype).to(DEV)
    pool = make_pool(gen, num_slots, (hv, dk, dv), torch.float32, slots, init) if use_pool else None
    before = pool.clone() if use_pool else None

    state0 = torch.zeros(bsz, hv, dk, dv, device=DEV)
    if use_pool:
        for i, (s, live) in enumerate(zip(slots, init)):
            if live:
                state0[i] = pool[s]
    g = -a_log.float().exp() * F.softplus(a_raw.float() + dt_bias.float())
    beta = b_raw.float().sigmoid()
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q[:, None].float(), k[:, None].float(), v[:, None].float(),
                                                  g[:, None], beta[:, None], state0, l2)
    out = torch.full((bsz, hv, dv), float("nan"), dtype=dtype, device=DEV)
    res = gated_delta_decode_triton(q, k, v, a_raw, b_raw, a_log, dt_bias, pool,
                                    torch.tensor(slots, device=DEV) if use_pool else None,
                                    torch.tensor(init, device=DEV), l2, out=out, block_v=block_v)
    assert res.data_ptr() == out.data_ptr()
    assert rel_err(out, o_ref[:, 0]) < TOL[dtype], rel_err(out, o_ref[:, 0])
    if use_pool:
        assert rel_err(pool[slots], s_ref) < 1e-5, rel_err(pool[slots], s_ref)
        rest = [s for s in range(num_slots) if s not in slots]
        assert same(pool[rest], before[rest])


@pytest.mark.parametrize("dtype", DTYPES, ids=dt_id)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_gdn_decode(case, dtype):
    bsz, hk, hv, dk, dv, init, l2, block_v = DECODE_CASES[case]
    run_decode_case(bsz, hk, hv, dk, dv, init, l2, block_v, dtype, seed=len(case))


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=dt_id)
def test_gdn_decode_without_pool(dtype):
    run_decode_case(3, 2, 4, 16, 32, [True, True, True], True, 16, dtype, seed=9, use_pool=False)


def test_gdn_decode_steps_follow_the_recurrence():
    # Three decode steps through the kernel equal the reference run over the three tokens at once.
    from lamina.kernels.triton_gdn_decode import gated_delta_decode_triton

    gen = torch.Generator().manual_seed(21)
    bsz, hk, hv, dk, dv, steps = 2, 1, 2, 16, 16, 3
    q, k = (torch.randn(bsz, steps, hk, dk, generator=gen).to(DEV) for _ in range(2))
    v = torch.randn(bsz, steps, hv, dv, generator=gen).to(DEV)
    a, b = (torch.randn(bsz, steps, hv, generator=gen).to(DEV) for _ in range(2))
    a_log, dt_bias = torch.randn(hv, generator=gen).to(DEV), torch.randn(hv, generator=gen).to(DEV)
    pool = torch.full((3, hv, dk, dv), float("nan"), device=DEV)
    slots = torch.tensor([2, 0], device=DEV)
    outs = [gated_delta_decode_triton(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], a_log, dt_bias, pool, slots,
                                      torch.tensor([t > 0] * bsz, device=DEV)) for t in range(steps)]
    g = -a_log.exp() * F.softplus(a + dt_bias)
    o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, g, b.sigmoid(), torch.zeros(bsz, hv, dk, dv, device=DEV))
    assert rel_err(torch.stack(outs, 1), o_ref) < 1e-5
    assert rel_err(pool[[2, 0]], s_ref) < 1e-5 and pool[1].isnan().all()


# ---------------------------------------------------------------------------------------------- graphs

@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_conv_and_decode_cuda_graph_replay():
    """Both kernels captured once (a decode step: conv over one token, then the recurrent step on views of
    its output), replayed with new inputs, slots and fresh/continuing flags."""
    from lamina.kernels.triton_conv1d import causal_conv1d_varlen_triton
    from lamina.kernels.triton_gdn_decode import gated_delta_decode_triton

    dtype = torch.bfloat16
    bsz, hk, hv, dk, dv, k_conv, num_slots = 8, 4, 8, 128, 128, 4, 20
    c = 2 * hk * dk + hv * dv
    gen = torch.Generator().manual_seed(1)
    proj = torch.randn(bsz, c + 2 * hv + 16, generator=gen).to(dtype).to(DEV)  # qkv | b | a | pad
    x, b_raw, a_raw = proj[:, :c], proj[:, c:c + hv], proj[:, c + hv:c + 2 * hv]
    w = (0.5 * torch.randn(c, k_conv, generator=gen)).to(dtype).to(DEV)
    bias = None
    a_log, dt_bias = torch.randn(hv, generator=gen).to(DEV), torch.randn(hv, generator=gen).to(dtype).to(DEV)
    conv_pool = torch.randn(num_slots, c, k_conv - 1, generator=gen).to(dtype).to(DEV)
    ssm_pool = torch.randn(num_slots, hv, dk, dv, generator=gen).to(DEV)
    qs = torch.arange(bsz + 1, dtype=torch.int32, device=DEV)
    slots = torch.arange(bsz, device=DEV)
    init = torch.ones(bsz, dtype=torch.bool, device=DEV)

    def step():
        y = causal_conv1d_varlen_triton(x, w, bias, conv_pool, qs, slots, init, 1)
        q = y[:, : hk * dk].view(bsz, hk, dk)
        k = y[:, hk * dk: 2 * hk * dk].view(bsz, hk, dk)
        v = y[:, 2 * hk * dk:].view(bsz, hv, dv)
        return y, gated_delta_decode_triton(q, k, v, a_raw, b_raw, a_log, dt_bias, ssm_pool, slots, init)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_g, o_g = step()
    for rep in range(3):
        proj.copy_(torch.randn(proj.shape, generator=gen).to(dtype))
        new_slots = torch.randperm(num_slots, generator=gen)[:bsz]
        new_init = torch.rand(bsz, generator=gen) < 0.6
        slots.copy_(new_slots)
        init.copy_(new_init)
        conv_ref, ssm_ref = conv_pool.float().clone(), ssm_pool.clone()
        graph.replay()
        sl, il = new_slots.tolist(), new_init.tolist()
        y_ref = causal_conv1d_varlen_ref(x.float(), w.float(), None, conv_ref, list(range(bsz + 1)), sl, il)
        assert rel_err(y_g, y_ref) < TOL[dtype], rep
        assert same(conv_pool.float(), conv_ref), rep
        # The decode oracle reads the kernel's own conv output so that only the recurrent step is compared.
        y = y_g.float()
        q = y[:, : hk * dk].view(bsz, 1, hk, dk)
        k = y[:, hk * dk: 2 * hk * dk].view(bsz, 1, hk, dk)
        v = y[:, 2 * hk * dk:].view(bsz, 1, hv, dv)
        state0 = ssm_ref[new_slots.to(DEV)] * new_init.to(DEV)[:, None, None, None]
        g = -a_log.exp() * F.softplus(a_raw.float() + dt_bias.float())
        o_ref, s_ref = recurrent_gated_delta_rule_ref(q, k, v, g[:, None], b_raw.float().sigmoid()[:, None], state0)
        assert rel_err(o_g, o_ref[:, 0]) < TOL[dtype], rep
        assert rel_err(ssm_pool[new_slots.to(DEV)], s_ref) < 1e-5, rep
        rest = [s for s in range(num_slots) if s not in sl]
        assert same(ssm_pool[rest], ssm_ref[rest]), rep
