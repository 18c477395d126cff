"""Triton recurrent gated delta rule over verify chunks (speculative decoding), keeping every state.

Contract: lamina.kernels.gated_delta.recurrent_verify_ref for each sequence of a flat varlen batch, with the
gates built from the raw projections as triton_gdn_decode does. Sequence b owns rows query_start[b] ..
query_start[b+1] (its last known token, then its drafts: L_b <= MAX_LEN tokens); after its token t < L_b - 1
the state goes to candidates[b, t], after the last to its own slot state_slots[b]. A one-token sequence
(no drafts) is exactly a decode step, so a decode batch with some verifying sequences runs in this one kernel.

Design: the decode kernel's tiling (grid (B, Hv, cdiv(dv, BLOCK_V)), S[:, v-block] in registers), with a
loop over the sequence's tokens (MAX_LEN, a constexpr, bounds it; rows past L_b are masked): the state is read
once, and written once per token (the candidates must be kept), which is the traffic. Device tensors only
(query_start, slots, candidates, has_initial_state), so it can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_gdn_decode import gdn_decode_tiles


@triton.jit
def _gdn_verify_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, cand_ptr,
                       init_ptr, qs_ptr, out_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_at, stride_ah, stride_bt, stride_bh, stride_ss, stride_sh, stride_sk, stride_cb,
                       stride_ot, stride_oh, scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, MAX_LEN: tl.constexpr,
                       L2NORM: tl.constexpr):
    bid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // GROUP
    kk = tl.arange(0, BLOCK_K)
    km = kk < DK
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = vv < DV
    smask = km[:, None] & vm[None, :]
    start = tl.load(qs_ptr + bid).to(tl.int64)
    length = tl.load(qs_ptr + bid + 1).to(tl.int64) - start
    slot = tl.load(slot_ptr + bid).to(tl.int64)
    s_off = h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    live = tl.load(init_ptr + bid) != 0
    s = tl.load(state_ptr + slot * stride_ss + s_off, mask=smask & live, other=0.0)
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    for t in range(MAX_LEN):
        on = t < length
        row = start + t
        q = tl.load(q_ptr + row * stride_qt + hk * stride_qh + kk, mask=km & on, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_kt + hk * stride_kh + kk, mask=km & on, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * stride_vt + h * stride_vh + vv, mask=vm & on, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * stride_at + h * stride_ah, mask=on, other=0.0).to(tl.float32)
        braw = tl.load(b_ptr + row * stride_bt + h * stride_bh, mask=on, other=0.0).to(tl.float32)
        x = a + dtb
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = neg_a * softplus
        beta = 1.0 / (1.0 + tl.exp(-braw))
        if L2NORM:
            q = q * tl.math.rsqrt(tl.sum(q * q, 0) + 1e-6)
            k = k * tl.math.rsqrt(tl.sum(k * k, 0) + 1e-6)
        q = q * scale
        s_new = s * tl.exp(g)
        kv = tl.sum(s_new * k[:, None], 0)
        delta = (v - kv) * beta
        s_new = s_new + k[:, None] * delta[None, :]
        o = tl.sum(s_new * q[:, None], 0)
        s = tl.where(on, s_new, s)  # rows past the sequence's end leave the state as it was
        tl.store(out_ptr + row * stride_ot + h * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=vm & on)
        # The state after token t: to candidate t, or (the last token) to the sequence's own slot.
        is_last = t == length - 1
        cand = tl.load(cand_ptr + bid * stride_cb + t, mask=on & (t < length - 1), other=0).to(tl.int64)
        dst = tl.where(is_last, slot, cand)
        tl.debug_barrier()  # the own slot's old state is read before the first write (t == 0 only)
        tl.store(state_ptr + dst * stride_ss + s_off, s, mask=smask & on)


def gated_delta_verify_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                              A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor,
                              query_start: torch.Tensor, state_slots: torch.Tensor, candidates: torch.Tensor,
                              has_initial_state: torch.Tensor, max_len: int, use_qk_l2norm: bool = True,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """q, k [T, Hk, dk]; v [T, Hv, dv]; a, b [T, Hv] raw projections; query_start [B+1] int; state_slots [B];
    candidates [B, >= max_len - 1] int64 (row b: its L_b - 1 candidate slots first); has_initial_state [B]
    bool; max_len >= every L_b. Returns out [T, Hv, dv] in q's dtype; the states land in ssm_states."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    total, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    bsz = state_slots.shape[0]
    assert ssm_states.dtype == torch.float32 and ssm_states.shape[1:] == (hv, dk, dv) and ssm_states.stride(-1) == 1
    assert candidates.dim() == 2 and candidates.shape[0] == bsz and candidates.stride(-1) == 1
    if out is None:
        out = torch.empty(total, hv, dv, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    block_k, bv, warps = gdn_decode_tiles(dk, dv)
    ss = ssm_states.stride()
    _gdn_verify_kernel[(bsz, hv, triton.cdiv(dv, bv))](
        q, k, v, a, b, A_log, dt_bias, ssm_states, state_slots, candidates, init, query_start, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), ss[0], ss[1], ss[2], candidates.stride(0), out.stride(0), out.stride(1),
        float(dk) ** -0.5, GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=bv, MAX_LEN=max_len,
        L2NORM=bool(use_qk_l2norm), num_warps=warps)
    return out
