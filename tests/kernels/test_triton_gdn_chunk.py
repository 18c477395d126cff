"""Triton chunked gated delta rule (varlen, state pool) against gated_delta_rule_varlen_ref on fresh random inputs.

Runs on a CUDA machine; on a CPU only under TRITON_INTERPRET=1 (tiny head dims, fp32/fp16 only: Triton 3.6's
interpreter computes bf16 dots on raw bits). The oracle is the reference on fp32 copies of the same inputs;
errors are ||out - oracle|| / ||oracle||. Pool slots the batch does not own hold NaN and must stay untouched;
the slots of fresh sequences (has_initial_state False) hold NaN too, so reading them would poison the output.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import CUDA, DEV, TOL, rel_err

from lamina.kernels.gated_delta import gated_delta_rule_varlen_ref


def make_batch(lens, hk, hv, dk, dv, dtype, seed, strided=False, beta_fp32=False):
    """Realistic magnitudes: g = -softplus(randn) (log decay), beta = sigmoid(randn), raw (unnormalized) q/k."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    if strided:  # q, k, v as views of one fused projection buffer (row stride = the whole row)
        width = 2 * hk * dk + hv * dv + 8
        buf = torch.randn(t, width, generator=gen).to(dtype).to(DEV)
        q = buf[:, :hk * dk].unflatten(1, (hk, dk))
        k = buf[:, hk * dk:2 * hk * dk].unflatten(1, (hk, dk))
        v = buf[:, 2 * hk * dk:2 * hk * dk + hv * dv].unflatten(1, (hv, dv))
        assert not q.is_contiguous() and q.stride(0) == width
    else:
        q = torch.randn(t, hk, dk, generator=gen).to(dtype).to(DEV)
        k = torch.randn(t, hk, dk, generator=gen).to(dtype).to(DEV)
        v = torch.randn(t, hv, dv, generator=gen).to(dtype).to(DEV)
    g = (-F.softplus(torch.randn(t, hv, generator=gen))).to(DEV)
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen)).to(torch.float32 if beta_fp32 else dtype).to(DEV)
    qs = [0]
    for n in lens:
        qs.append(qs[-1] + n)
    return q, k, v, g, beta, qs, gen


def run_case(lens, hk, hv, dk, dv, dtype, seed, *, pool=True, init=None, strided=False, l2norm=True,
             beta_fp32=False, tol=None):
    from lamina.kernels.triton_gdn_chunk import chunk_gated_delta_varlen_triton

    q, k, v, g, beta, qs, gen = make_batch(lens, hk, hv, dk, dv, dtype, seed, strided, beta_fp32)
    b = len(lens)
    init = [i % 2 == 1 for i in range(b)] if init is None else init
    if pool:
        n_slots = b + 3
        slots = torch.randperm(n_slots, generator=gen)[:b].tolist()
        ssm = torch.full((n_slots, hv, dk, dv), float("nan"))
        for i, s in enumerate(slots):
            if init[i]:  # a continuing sequence: a random state of the scale a real one has
                ssm[s] = 0.3 * torch.randn(hv, dk, dv, generator=gen)
        ssm = ssm.to(DEV)
        ssm_ref = ssm.clone()
        slots_t = torch.tensor(slots, dtype=torch.int64, device=DEV)
        init_t = torch.tensor(init, dtype=torch.bool, device=DEV)
    else:
        ssm = ssm_ref = slots = slots_t = init_t = None
    oracle = gated_delta_rule_varlen_ref(q.float(), k.float(), v.float(), g.float(), beta.float(), ssm_ref, qs, slots,
                                         init, l2norm)
    out = chunk_gated_delta_varlen_triton(q, k, v, g, beta, ssm, torch.tensor(qs, dtype=torch.int32, device=DEV),
                                          slots_t, init_t, l2norm)
    assert out.dtype == dtype and out.shape == v.shape
    tol = tol or TOL[dtype]
    err = rel_err(out, oracle)
    assert err < tol, ("out", err)
    if pool:
        owned = torch.zeros(ssm.shape[0], dtype=torch.bool)
        owned[slots] = True
        other = ssm[~owned.to(DEV)]
        assert other.isnan().all(), "a slot outside the batch was written"
        live = slots_t[torch.tensor(lens, device=DEV) > 0]
        st_err = rel_err(ssm[live], ssm_ref[live])
        assert st_err < tol, ("state", st_err)
        empty = slots_t[torch.tensor(lens, device=DEV) == 0]  # untouched: equal to what they held (NaN or not)
        assert torch.equal(ssm[empty].nan_to_num(7.0), ssm_ref[empty].nan_to_num(7.0))
    return err


def small_dtypes():
    return [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _ids(d):
    return str(d)[6:]


@pytest.mark.parametrize("dtype", small_dtypes(), ids=_ids)
def test_one_sequence_several_chunks(dtype):
    # 3 chunks, the last one partial; fresh and continuing
    run_case([150], 1, 1, 16, 32, dtype, seed=1, init=[False])
    run_case([150], 1, 1, 32, 16, dtype, seed=2, init=[True])


@pytest.mark.parametrize("dtype", small_dtypes(), ids=_ids)
def test_varlen_mixed_lengths_grouped_heads(dtype):
    # decode rows (length 1), chunk boundaries at 63/64/65, a multi-chunk sequence; Hv = 2 Hk
    run_case([1, 63, 64, 65, 150, 1], 2, 4, 16, 16, dtype, seed=3, init=[True, False, True, True, False, False])


@pytest.mark.parametrize("dtype", small_dtypes(), ids=_ids)
def test_strided_views_no_pool(dtype):
    # q/k/v views of one fused buffer; no pool: zero initial states and nothing written; beta in fp32
    run_case([70, 1, 33], 2, 4, 32, 16, dtype, seed=4, pool=False, strided=True, beta_fp32=True)


@pytest.mark.parametrize("dtype", small_dtypes()[:2], ids=_ids)
def test_empty_sequences_as_in_a_padded_graph_batch(dtype):
    # A CUDA graph's batch: the step's sequences (decode rows among them), a padding sequence owning the tail
    # rows, then empty slots (length 0): the empty ones must compute and write nothing (their slots keep their
    # contents), and the chunk grids sized from T // 64 + B leave unused indices idle.
    run_case([1, 70, 1, 1, 9, 0, 0, 0], 1, 2, 16, 16, dtype, seed=12,
             init=[True, False, True, True, False, True, True, False])
    run_case([0, 64, 0, 1], 1, 2, 16, 16, dtype, seed=13, init=[True, True, False, True])


def test_without_l2norm_and_decode_only_batch():
    # no normalisation when asked not to (q is still scaled by dk^-0.5); a batch of decode rows only
    run_case([5, 90], 1, 2, 16, 16, torch.float32, seed=5, l2norm=False, init=[True, True])
    run_case([1, 1, 1, 1], 1, 2, 16, 16, torch.float32, seed=6, init=[True, False, True, True])


def test_longer_sequence_and_odd_head_dims():
    # five chunks at dk=dv=64 continuing from a state; head dims that are not powers of two (masked tiles)
    run_case([300], 1, 2, 64, 64, torch.float16, seed=10, init=[True])
    run_case([100, 1, 20], 1, 2, 24, 40, torch.float32, seed=11)


@pytest.mark.skipif(not CUDA, reason="dk=dv=128 and bf16 dots need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=_ids)
def test_cuda_head_dim_128(dtype):
    # Qwen3-Next's head shape (Hk=16, Hv=32 at full size), a varlen batch with decode rows and chunked prefills
    run_case([1, 700, 64, 1, 129, 2048], 4, 8, 128, 128, dtype, seed=7, strided=True)
    run_case([4096], 16, 32, 128, 128, dtype, seed=8, init=[True])


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("bv", [16, 32, 64])
def test_cuda_state_tiles(bv):
    # every state-kernel BV the size heuristic can pick (or a sweep can ask for) computes the same function
    from lamina.kernels.triton_gdn_chunk import chunk_gated_delta_varlen_triton

    q, k, v, g, beta, qs, _ = make_batch([300, 1, 77], 2, 4, 128, 128, torch.bfloat16, seed=9)
    ref = gated_delta_rule_varlen_ref(q.float(), k.float(), v.float(), g, beta.float(), None, qs, None, [False] * 3)
    out = chunk_gated_delta_varlen_triton(q, k, v, g, beta, None, torch.tensor(qs, dtype=torch.int32, device=DEV),
                                          None, None, tune={"state_bv": bv, "state_warps": 8 if bv == 64 else 4})
    assert rel_err(out, ref) < TOL[torch.bfloat16]
