"""Triton GDN decode step with its causal conv1d update fused in: raw in_proj qkv rows -> core output, conv and
recurrent states updated in place (one launch instead of the conv kernel + the recurrent kernel).

Contract: causal_conv1d_varlen_ref (decode rows, silu) followed by the recurrent gated delta rule of
triton_gdn_decode.py on its output, for a decode-only step (one token per sequence). x [B, C] raw qkv rows
(C = 2 * Hk * dk + Hv * dv, any row stride), conv weight [C, KW] (+ bias [C]), conv_states [slots, C, KW-1]
(oldest first), ssm_states [slots, Hv, dk, dv] fp32; state_slots / has_initial_state per sequence.

Data flow. The recurrent program (sequence b, value head h, BLOCK_V value columns) needs the conv output of
its key head's q and k channels (dk each) and of its own v channels. It computes them itself from the old
conv window and x (K-1 loads of the state plus one of x per channel, from L2), rounded to x's dtype as the
unfused conv's output is, so the conv's [B, C] output round trip and its launch go. v channels belong to one
program, which writes their new window after a barrier. q/k channels are read by the GROUP * NVB programs of
that key head: each reads the old window, then bumps a per-(sequence, key head) counter (acq_rel, after a
CTA barrier); the program that arrives last writes their new window and resets the counter, so no program
can read a window already rolled forward, and the next launch or graph replay finds the counters zero.
Counters are indexed by batch row, not slot (padded graph rows may share a slot).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_gdn_decode import gdn_decode_tiles


@triton.jit
def _conv_channels(x_ptr, cw_ptr, cb_ptr, conv_ptr, chans, cmask, bid, slot, live, stride_x, stride_cs,
                   stride_cc, stride_wc, KW: tl.constexpr, BLOCK_W: tl.constexpr, HAS_CB: tl.constexpr,
                   HAS_STATE: tl.constexpr):
    """silu(conv) of the given channels (rounded to x's dtype, as fp32) and their old window [N, BLOCK_W]."""
    j = tl.arange(0, BLOCK_W)
    jm = j < KW - 1
    if HAS_STATE:
        win = tl.load(conv_ptr + slot * stride_cs + chans[:, None].to(tl.int64) * stride_cc + j[None, :],
                      mask=cmask[:, None] & jm[None, :] & live, other=0.0).to(tl.float32)
    else:
        win = tl.zeros([chans.shape[0], BLOCK_W], tl.float32)
    xc = tl.load(x_ptr + bid * stride_x + chans, mask=cmask, other=0.0)
    w_hist = tl.load(cw_ptr + chans[:, None] * stride_wc + j[None, :], mask=cmask[:, None] & jm[None, :],
                     other=0.0).to(tl.float32)
    w_cur = tl.load(cw_ptr + chans * stride_wc + (KW - 1), mask=cmask, other=0.0).to(tl.float32)
    acc = tl.sum(win * w_hist, axis=1) + xc.to(tl.float32) * w_cur
    if HAS_CB:
        acc += tl.load(cb_ptr + chans, mask=cmask, other=0.0).to(tl.float32)
    y = (acc / (1.0 + tl.exp(-acc))).to(x_ptr.dtype.element_ty).to(tl.float32)
    return y, win, xc


@triton.jit
def _roll_window(conv_ptr, chans, cmask, slot, win, xc, stride_cs, stride_cc, KW: tl.constexpr,
                 BLOCK_W: tl.constexpr):
    """conv_states[slot, chans] <- (old window without its oldest column | x)."""
    j = tl.arange(0, BLOCK_W)
    base = conv_ptr + slot * stride_cs + chans.to(tl.int64) * stride_cc
    for c in tl.static_range(KW - 1):
        if c < KW - 2:
            col = tl.sum(tl.where(j[None, :] == c + 1, win, 0.0), axis=1)
        else:
            col = xc.to(tl.float32)
        tl.store(base + c, col.to(conv_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _gdn_conv_decode_kernel(x_ptr, cw_ptr, cb_ptr, conv_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr,
                            init_ptr, cnt_ptr, out_ptr, num_k_heads, stride_x, stride_cs, stride_cc, stride_wc,
                            stride_ab, stride_bb, stride_ss, stride_sh, stride_sk, stride_ob, stride_oh, scale,
                            GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                            BLOCK_V: tl.constexpr, KW: tl.constexpr, BLOCK_W: tl.constexpr, HAS_CB: tl.constexpr,
                            HAS_STATE: tl.constexpr, HAS_INIT: tl.constexpr, L2NORM: tl.constexpr):
    bid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // GROUP
    kk = tl.arange(0, BLOCK_K)
    km = kk < DK
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = vv < DV
    smask = km[:, None] & vm[None, :]
    key_dim = num_k_heads * DK

    slot = bid  # unused without a pool
    live = True
    if HAS_STATE:
        slot = tl.load(slot_ptr + bid).to(tl.int64)
        if HAS_INIT:
            live = tl.load(init_ptr + bid) != 0
        s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
        s = tl.load(s_ptrs, mask=smask & live, other=0.0)
    else:
        s = tl.zeros([BLOCK_K, BLOCK_V], tl.float32)

    q_ch = hk * DK + kk
    k_ch = key_dim + hk * DK + kk
    v_ch = 2 * key_dim + h * DV + vv
    q, q_win, q_x = _conv_channels(x_ptr, cw_ptr, cb_ptr, conv_ptr, q_ch, km, bid, slot, live, stride_x, stride_cs,
                                   stride_cc, stride_wc, KW, BLOCK_W, HAS_CB, HAS_STATE)
    k, k_win, k_x = _conv_channels(x_ptr, cw_ptr, cb_ptr, conv_ptr, k_ch, km, bid, slot, live, stride_x, stride_cs,
                                   stride_cc, stride_wc, KW, BLOCK_W, HAS_CB, HAS_STATE)
    v, v_win, v_x = _conv_channels(x_ptr, cw_ptr, cb_ptr, conv_ptr, v_ch, vm, bid, slot, live, stride_x, stride_cs,
                                   stride_cc, stride_wc, KW, BLOCK_W, HAS_CB, HAS_STATE)
    if HAS_STATE:
        tl.debug_barrier()  # every thread's reads of the old windows are done
        _roll_window(conv_ptr, v_ch, vm, slot, v_win, v_x, stride_cs, stride_cc, KW, BLOCK_W)
        arrived = tl.atomic_add(cnt_ptr + bid * num_k_heads + hk, 1, sem="acq_rel", scope="gpu")
        if arrived == GROUP * tl.num_programs(2) - 1:  # every reader of this key head's q/k windows is past them
            _roll_window(conv_ptr, q_ch, km, slot, q_win, q_x, stride_cs, stride_cc, KW, BLOCK_W)
            _roll_window(conv_ptr, k_ch, km, slot, k_win, k_x, stride_cs, stride_cc, KW, BLOCK_W)
            tl.atomic_xchg(cnt_ptr + bid * num_k_heads + hk, 0, sem="relaxed", scope="gpu")

    a = tl.load(a_ptr + bid * stride_ab + h).to(tl.float32)
    braw = tl.load(b_ptr + bid * stride_bb + h).to(tl.float32)
    xg = a + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(xg > 20.0, xg, tl.log(1.0 + tl.exp(tl.minimum(xg, 20.0))))  # torch's threshold 20
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
        tl.debug_barrier()  # all reads of the old recurrent state before the first write
        tl.store(s_ptrs, s, mask=smask)
    tl.store(out_ptr + bid * stride_ob + h * stride_oh + vv, o.to(out_ptr.dtype.element_ty), mask=vm)


def new_conv_counters(max_rows: int, num_k_heads: int, device: torch.device) -> torch.Tensor:
    """Per-(batch row, key head) arrival counters: zero, and every launch leaves them zero."""
    return torch.zeros(max_rows * num_k_heads, dtype=torch.int32, device=device)


def gdn_conv_decode_triton(x: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                           conv_states: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                           dt_bias: torch.Tensor, ssm_states: torch.Tensor | None, state_slots: torch.Tensor | None,
                           has_initial_state: torch.Tensor | None, counters: torch.Tensor, num_k_heads: int,
                           head_k_dim: int, num_v_heads: int, head_v_dim: int, use_qk_l2norm: bool = True,
                           block_v: int | None = None) -> torch.Tensor:
    """x [B, C] raw qkv rows (unit column stride); a, b [B, Hv] (unit column stride) -> core [B, Hv, dv].

    Both pools (conv_states, ssm_states) or neither (zero states, nothing written); counters from
    new_conv_counters with at least B * Hk entries."""
    bsz, c = x.shape
    hk, dk, hv, dv = num_k_heads, head_k_dim, num_v_heads, head_v_dim
    kw = conv_weight.shape[-1]
    assert c == 2 * hk * dk + hv * dv and conv_weight.shape == (c, kw) and kw >= 2 and hv % hk == 0
    assert x.stride(-1) == 1 and a.stride(-1) == 1 and b.stride(-1) == 1 and conv_weight.stride(-1) == 1
    out = torch.empty(bsz, hv, dv, dtype=x.dtype, device=x.device)
    if bsz == 0:
        return out
    has_state = conv_states is not None and ssm_states is not None and state_slots is not None
    if has_state:
        assert conv_states.shape[1:] == (c, kw - 1) and conv_states.stride(-1) == 1
        assert ssm_states.dtype == torch.float32 and ssm_states.shape[1:] == (hv, dk, dv)
        assert ssm_states.stride(-1) == 1 and state_slots.shape == (bsz,) and counters.numel() >= bsz * hk
    has_init = has_state and has_initial_state is not None
    init = has_initial_state.view(torch.uint8) if has_init and has_initial_state.dtype == torch.bool else \
        (has_initial_state if has_init else x)
    cs = conv_states.stride() if has_state else (0, 0, 0)
    ss = ssm_states.stride() if has_state else (0, 0, 0, 0)
    block_k, bv, warps = gdn_decode_tiles(dk, dv)
    bv = block_v or bv
    grid = (bsz, hv, triton.cdiv(dv, bv))
    _gdn_conv_decode_kernel[grid](
        x, conv_weight, conv_bias if conv_bias is not None else conv_weight,
        conv_states if has_state else x, a, b, A_log, dt_bias, ssm_states if has_state else out,
        state_slots if has_state else x, init, counters, out, hk, x.stride(0), cs[0], cs[1], conv_weight.stride(0),
        a.stride(0), b.stride(0), ss[0], ss[1], ss[2], out.stride(0), out.stride(1), float(dk) ** -0.5,
        GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=bv, KW=kw, BLOCK_W=triton.next_power_of_2(kw - 1),
        HAS_CB=conv_bias is not None, HAS_STATE=has_state, HAS_INIT=has_init, L2NORM=bool(use_qk_l2norm),
        num_warps=warps)
    return out
