"""Triton recurrent gated-delta-rule decode step (one token per sequence), state updated in place.

Contract: lamina.kernels.gated_delta.recurrent_gated_delta_rule_ref with L = 1, the decay and rate built from
the raw projections as GatedDeltaNet.forward does: g = -exp(A_log) * softplus(a + dt_bias), beta =
sigmoid(b). Per value head h (reading q/k head h // (Hv // Hk)) and state S [dk, dv] fp32:
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  out = S^T q
with q, k L2-normalized (x * rsqrt(sum x^2 + 1e-6)) and q scaled by dk^-0.5, all in fp32 in the kernel.

Design
- Grid (B, Hv, cdiv(dv, BLOCK_V)); a program owns S[:, v-block] of one (sequence, head) in registers:
  one read and one write of the state, the only real traffic (32 heads x 128 x 128 x 4 B = 2 MB per sequence
  per layer for Qwen3-Next), so the kernel is bandwidth bound; q/k (and their norms) are recomputed per
  v-block, which costs 2 x dk loads from L2. The two reductions over dk (S^T k, S^T q) order every state
  load before any store; a barrier before the store makes that explicit for replicated layouts.
- Tiles: BLOCK_V = min(next_pow2(dv), max(16, 4096 // BLOCK_K)), 4 warps from 2048 state elements up:
  dk=128 -> 128x32 (4 v-blocks per head, so B=1 still gives Hv*4 programs), dk=64 -> 64x64. ptxas -v
  for sm_90 (bf16 inputs, compiled on the CPU with the runtime's 16-divisibility attrs): 128x32 96
  registers (8 LDG.E.128 + 8 STG.E.128 of state per thread: 16 KB per program in flight, 5 programs per
  SM by registers), 128x16 56, 128x64 165, 64x64 96; none spill.
- A sequence whose has_initial_state is False reads nothing (zero state) and writes its slot; no pool
  (ssm_states or state_slots None): zero state, nothing written. Padded rows of a captured batch may point
  at a spare slot. No host syncs and no per-batch integers reach the kernel (B only sizes the grid), so
  it can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_decode_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, init_ptr,
                       out_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab,
                       stride_ah, stride_bb, stride_bh, stride_ss, stride_sh, stride_sk, stride_ob, stride_oh,
                       scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_V: tl.constexpr, HAS_STATE: tl.constexpr, HAS_INIT: tl.constexpr,
                       L2NORM: tl.constexpr):
    bid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // GROUP
    kk = tl.arange(0, BLOCK_K)
    km = kk < DK
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = vv < DV
    smask = km[:, None] & vm[None, :]

    # The state load goes first: it is the traffic that matters, everything else hides under it.
    if HAS_STATE:
        slot = tl.load(slot_ptr + bid).to(tl.int64)
        s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
        if HAS_INIT:
            live = tl.load(init_ptr + bid) != 0
            s = tl.load(s_ptrs, mask=smask & live, other=0.0)
        else:
            s = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)
    else:
        s = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)

    q = tl.load(q_ptr + bid * stride_qb + hk * stride_qh + kk, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + bid * stride_kb + hk * stride_kh + kk, mask=km, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + bid * stride_vb + h * stride_vh + vv, mask=vm, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + bid * stride_ab + h * stride_ah).to(tl.float32)
    braw = tl.load(b_ptr + bid * stride_bb + h * stride_bh).to(tl.float32)
    x = a + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold 20
    g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus
    beta = 1.0 / (1.0 + tl.exp(-braw))
    if L2NORM:
        q = q * tl.math.rsqrt(tl.sum(q * q, 0) + 1e-6)
        k = k * tl.math.rsqrt(tl.sum(k * k, 0) + 1e-6)
    q = q * scale

    s = s * tl.exp(g)
    kv = tl.sum(s * k[:, None], 0)  # S^T k
    delta = (v - kv) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)  # S^T q
    if HAS_STATE:
        tl.debug_barrier()  # all reads of the old state before the first write (replicated layouts)
        tl.store(s_ptrs, s, mask=smask)
    tl.store(out_ptr + bid * stride_ob + h * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=vm)


def gdn_decode_tiles(dk: int, dv: int) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_V, num_warps)."""
    block_k = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), max(16, 4096 // block_k))
    warps = 4 if block_k * block_v >= 2048 else (2 if block_k * block_v >= 512 else 1)
    return block_k, block_v, warps


def gated_delta_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                              b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                              ssm_states: torch.Tensor | None, state_slots: torch.Tensor | None,
                              has_initial_state: torch.Tensor | None, use_qk_l2norm: bool = True, *,
                              out: torch.Tensor | None = None, block_v: int | None = None,
                              num_warps: int | None = None) -> torch.Tensor:
    """q, k [B, Hk, dk]; v [B, Hv, dv]; a, b [B, Hv] raw projections; A_log, dt_bias [Hv].

    Returns out [B, Hv, dv] in q's dtype; ssm_states[state_slots[i]] ([Hv, dk, dv] fp32) updated in place.
    has_initial_state [B] bool (device); None means every sequence starts fresh. block_v / num_warps
    override the tiles (tests, sweeps).
    """
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    bsz, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert k.shape == q.shape and v.shape[0] == bsz and hv % hk == 0
    assert a.shape == (bsz, hv) and b.shape == (bsz, hv)
    if out is None:
        out = torch.empty(bsz, hv, dv, dtype=q.dtype, device=q.device)
    assert out.shape == (bsz, hv, dv) and out.stride(-1) == 1
    if bsz == 0:
        return out
    has_state = ssm_states is not None and state_slots is not None
    has_init = has_state and has_initial_state is not None
    if has_state:
        assert ssm_states.dtype == torch.float32 and ssm_states.shape[1:] == (hv, dk, dv)
        assert ssm_states.stride(-1) == 1
        state, slots, ss = ssm_states, state_slots, ssm_states.stride()
    else:
        state, slots, ss = out, q, (0, 0, 0, 0)
    if has_init:
        assert has_initial_state.shape == (bsz,) and has_initial_state.stride(0) == 1
        init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    else:
        init = q
    assert not has_state or (state_slots.shape == (bsz,) and state_slots.stride(0) == 1)
    block_k, bv, warps = gdn_decode_tiles(dk, dv)
    bv, warps = block_v or bv, num_warps or warps
    grid = (bsz, hv, triton.cdiv(dv, bv))
    _gdn_decode_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, slots, init, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), ss[0], ss[1], ss[2], out.stride(0), out.stride(1), float(dk) ** -0.5,
        GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=bv, HAS_STATE=has_state, HAS_INIT=has_init,
        L2NORM=bool(use_qk_l2norm), num_warps=warps)
    return out
