"""Triton MoE decode path for a handful of tokens: routing in one launch, the weighted sum over experts folded
into the down projection (the torch references are in moe_decode.py).

Routing (`_route_kernel`, grid = blocks of BLOCK_E router rows): each program computes the router logits of
every token (T <= MAX_TOKENS) for its rows on the CUDA cores, rounds them to the activations' dtype (the
unfused path's F.linear does, so routing ties break the same way) and stores them as fp32 in a per-call
workspace. Then, as the decode GEMV's split-K does, it bumps a counter (acq_rel, after a CTA barrier); the
program that arrives last scores the whole [T, E] tile (softmax, or sigmoid with an optional selection bias),
takes the top k by k argmax passes (lowest index among ties), renormalizes, scales (routed_scaling_factor),
appends the folded shared expert (sigmoid of its gate logit, id E) or DeepSeek's folded ungated shared experts
(weight 1, ids E..; fp32 router rows and unrounded logits there, as HF's DeepSeek router) and resets the
counter, so the next launch or a graph replay finds it zero. One launch replaces the router GEMV and the
top-k kernel; no host sync, grids from host shapes only.

Down projection (`_down_sum_kernel`, grid = (token, BLOCK_N output columns)): a program loads the token's
slot ids and weights, streams BLOCK_N rows of each chosen expert's down weights ([BLOCK_S, BLOCK_N, BLOCK_K]
tiles, padded slots masked: no bytes), accumulates in fp32, scales by the routing weights and sums the slots
in registers in a fixed order, then writes out[t] once in x's dtype. Deterministic, no atomics, no
[T, k, H] intermediate and no separate sum kernel. The gate|up step reuses triton_moe's per-pair GEMV.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from lamina.kernels.triton_moe import _gemv1_kernel
from lamina.kernels.triton_moe_stream import down_stream, gate_up_stream, pdl_args

MAX_TOKENS = 16  # the fused decode path takes at most this many tokens (routing tile [16, E] in one program)
SCORES = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class ExpertTiles:
    """How the gate|up and down steps run. gate_up: "pair" (triton_moe's one-shot per-pair GEMV, 8 rows x whole
    K per program, 97 regs at 8 warps: 2 programs per SM) or "stream" (triton_moe_stream: persistent, next tile
    prefetched); down: "sum" (_down_sum_kernel, [16 slots, block_n, block_k] tiles looped over K) or "stream".
    Registers (ptxas sm_90, bf16, Qwen3-Next shape; no spills): gate|up stream n2 w8 96 (2 per SM), n4 w8 148
    (1 per SM), n1 w4 95 (5 per SM); down stream n1 w8 90 (2 per SM), n1 w4 152 (3 per SM), n2 w8 202 (1 per
    SM); route 55 at T = 1 (4 or 2 warps), 119 at T = 4 (4 warps). scripts/ptxas_moe_decode.py prints them."""
    gate_up: str = "stream"
    gu_block_n: int = 2
    gu_warps: int = 8
    gu_per_sm: int = 2
    down: str = "stream"
    down_block_n: int = 1
    down_block_k: int | None = None  # "sum" only; None: whole K up to 8192 elements per tile
    down_warps: int = 4
    down_per_sm: int = 3
    route_warps: int | None = None  # None: 4, or 8 for [T, E] tiles of >= 4096 (the morning's choice)
    pdl: bool = False  # all three launches with programmatic dependent launch (stream kernels only)


# The morning's kernels as they ran on the H200 (2026-12-01e): the sweep's baseline.
MORNING_TILES = ExpertTiles(gate_up="pair", down="sum", down_block_n=4, down_warps=4)
# Measured on the H200 (scripts/moe_decode_sweep.py, 2026-12-02, Qwen3-Next layer, 16 routings per graph; raw
# benchmarks/results/2026-12-02b/kernels/moesweep.log): the whole block route + gate|up + down at T = 1 / 2 / 4
# took 38.8 / 65.1 / 101.3 us with MORNING_TILES, 39.4 / 66.0 / 116.0 with both steps streamed, and the best
# pairs 33.0 / 53.7 / 86.7 us. Streamed gate|up at 1 row x 4 warps x 5 programs per SM was best or within
# 3 us of the one-shot kernel at every T; the streamed down lost everywhere (37-48% of copy bandwidth) to the
# looped down+sum at 8 output columns x 128 K (52% at T = 1, 73-80% at T = 2-4). So: those two.
DEFAULT_TILES = ExpertTiles(gate_up="stream", gu_block_n=1, gu_warps=4, gu_per_sm=5, down="sum", down_block_n=8,
                            down_block_k=128, down_warps=4)
# The stream kernels give way to the one-shot ones when a tile would not fit the registers (large H or I):
STREAM_TILE_MAX = 16384  # elements of one tile: down 16 slots x block_n x next_pow2(I), gate|up 2 x block_n x H


@triton.jit(do_not_specialize=["T"])
def _route_kernel(x_ptr, w_ptr, bias_ptr, logit_ptr, cnt_ptr, wout_ptr, iout_ptr, T, E, H, stride_xm, stride_wn,
                  scale, TOP_K: tl.constexpr, SHARED: tl.constexpr, FIXED: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ALL: tl.constexpr, BLOCK_SLOT: tl.constexpr,
                  SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, ROUND: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr,
                  PDL: tl.constexpr = False):
    if PDL:  # launched early: x is the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    e_tot = E + SHARED  # router rows: routed experts, then the shared expert's gate
    offs_t = tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < e_tot
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + offs_k) < H
        xt = tl.load(x_ptr + offs_t[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=t_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :],
                     mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)
    if ROUND:  # the logits the unfused F.linear rounds to x's dtype (DeepSeek's fp32 router does not)
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logit_ptr + offs_t[:, None] * e_tot + offs_e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])
    tl.debug_barrier()  # every thread's logits are issued before the counter is released
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:  # the last program routes every token
        e_all = tl.arange(0, BLOCK_ALL)
        ok = e_all < E
        lg = tl.load(logit_ptr + offs_t[:, None] * e_tot + e_all[None, :], mask=t_ok[:, None] & ok[None, :],
                     other=0.0, cache_modifier=".cg")
        if SIGMOID:
            probs = tl.where(ok[None, :], tl.sigmoid(lg), 0.0)
        else:
            lg = tl.where(ok[None, :], lg, float("-inf"))
            p = tl.exp(lg - tl.max(lg, axis=1)[:, None])
            probs = p / tl.sum(p, axis=1)[:, None]
        sel = probs
        if HAS_BIAS:  # selection only (DeepSeek's score correction); the weights stay the scores
            sel = probs + tl.load(bias_ptr + e_all, mask=ok, other=0.0).to(tl.float32)[None, :]
        sel = tl.where(ok[None, :], sel, float("-inf"))
        if N_GROUP > 1:  # DeepSeek's group-limited choice (E a power of two, E == BLOCK_ALL)
            sel = _keep_groups(sel, BLOCK_T, BLOCK_ALL, N_GROUP, TOPK_GROUP, GROUP_TOP2)
        slot = tl.arange(0, BLOCK_SLOT)
        wsel = tl.zeros([BLOCK_T, BLOCK_SLOT], dtype=tl.float32)
        isel = tl.zeros([BLOCK_T, BLOCK_SLOT], dtype=tl.int32)
        for i in tl.static_range(TOP_K):
            _, idx = tl.max(sel, axis=1, return_indices=True, return_indices_tie_break_left=True)
            chosen = e_all[None, :] == idx[:, None]
            wv = tl.sum(tl.where(chosen, probs, 0.0), axis=1)
            wsel = tl.where(slot[None, :] == i, wv[:, None], wsel)
            isel = tl.where(slot[None, :] == i, idx[:, None], isel)
            sel = tl.where(chosen, float("-inf"), sel)
        if RENORM:
            wsel = wsel / tl.sum(tl.where(slot[None, :] < TOP_K, wsel, 0.0), axis=1)[:, None]
        wsel = wsel * scale  # routed_scaling_factor (1 outside DeepSeek)
        width = TOP_K + SHARED + FIXED
        if SHARED:  # the shared expert, folded in as expert E: always chosen, weight sigmoid(its gate logit)
            s = tl.load(logit_ptr + offs_t * e_tot + E, mask=t_ok, other=0.0, cache_modifier=".cg")
            wsel = tl.where(slot[None, :] == TOP_K, tl.sigmoid(s)[:, None], wsel)
            isel = tl.where(slot[None, :] == TOP_K, E, isel)
        if FIXED > 0:  # ungated shared experts folded in as experts E.. E+FIXED-1: always chosen, weight 1
            fixed = (slot[None, :] >= TOP_K) & (slot[None, :] < width)
            wsel = tl.where(fixed, 1.0, wsel)
            isel = tl.where(fixed, E + slot[None, :] - TOP_K, isel)
        out_mask = t_ok[:, None] & (slot[None, :] < width)
        dst = offs_t[:, None] * width + slot[None, :]
        tl.store(wout_ptr + dst, wsel.to(wout_ptr.dtype.element_ty), mask=out_mask)
        tl.store(iout_ptr + dst, isel.to(tl.int64), mask=out_mask)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _keep_groups(sel, BLOCK_T: tl.constexpr, BLOCK_ALL: tl.constexpr, N_GROUP: tl.constexpr,
                 TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr):
    """sel [T, E] with the experts outside each token's TOPK_GROUP best groups set to -inf. A group's score is
    its best selection score, or (TOP2: DeepSeek-V3's noaux_tc) the sum of its two best; groups by k argmax
    passes, lowest index among ties (as the expert choice)."""
    GS: tl.constexpr = BLOCK_ALL // N_GROUP
    s3 = tl.reshape(sel, (BLOCK_T, N_GROUP, GS))
    m1 = tl.max(s3, axis=2)
    gscore = m1
    if TOP2 and GS > 1:
        eq = s3 == m1[:, :, None]
        second = tl.max(tl.where(eq, float("-inf"), s3), axis=2)
        gscore = m1 + tl.where(tl.sum(eq.to(tl.int32), axis=2) >= 2, m1, second)  # a tied best counts twice
    g = tl.arange(0, N_GROUP)
    keep = tl.zeros([BLOCK_T, N_GROUP], dtype=tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        _, gi = tl.max(gscore, axis=1, return_indices=True, return_indices_tie_break_left=True)
        hit = g[None, :] == gi[:, None]
        keep = tl.where(hit, 1, keep)
        gscore = tl.where(hit, float("-inf"), gscore)
    s3 = tl.where(keep[:, :, None] != 0, s3, float("-inf"))
    return tl.reshape(s3, (BLOCK_T, BLOCK_ALL))


@triton.jit
def _down_sum_kernel(a_ptr, w_ptr, out_ptr, ids_ptr, wts_ptr, S, N, K, stride_am, stride_we, stride_wn, stride_om,
                     BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, n] = sum_s weight[t, s] * (inter[t*S + s] . w2[ids[t, s], n]), slots summed in registers."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    s = tl.arange(0, BLOCK_S)
    s_ok = s < S
    pair = t * S + s
    e = tl.load(ids_ptr + pair, mask=s_ok, other=0).to(tl.int64)
    wt = tl.load(wts_ptr + pair, mask=s_ok, other=0.0).to(tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + e[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_S, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptr + pair[:, None] * stride_am + (k0 + offs_k)[None, :], mask=s_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_rows + (k0 + offs_k)[None, None, :],
                    mask=s_ok[:, None, None] & n_ok[None, :, None] & k_ok[None, None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[:, None, :], axis=2)
    y = tl.sum(acc * wt[:, None], axis=0)
    tl.store(out_ptr + t * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def new_route_counter(device: torch.device) -> torch.Tensor:
    """The routing kernel's arrival counter: zero, and every launch leaves it zero (keep it: graphs hold it)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def route_triton(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool, shared: bool,
                 counter: torch.Tensor, score: str = "softmax", bias: torch.Tensor | None = None,
                 block_e: int | None = None, *, round_logits: bool = True, scale: float = 1.0,
                 fixed: int = 0, n_group: int = 1, topk_group: int = 1,
                 group_top2: bool = False, warps: int | None = None, pdl: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (T <= MAX_TOKENS), gate_weight [E (+1 shared row), H] (x's dtype, or fp32 as DeepSeek's
    router) -> (weights [T, k(+1 or +fixed)] in x's dtype, ids int64), as moe_decode.route_ref. counter:
    new_route_counter, not shared with a launch in flight on another stream."""
    assert score in SCORES and x.dim() == 2 and 1 <= x.shape[0] <= MAX_TOKENS and not (shared and fixed)
    assert x.stride(-1) == 1 and gate_weight.stride(-1) == 1 and gate_weight.shape[1] == x.shape[1]
    t, h = x.shape
    e_tot = gate_weight.shape[0]
    e = e_tot - int(shared)
    width = top_k + int(shared) + fixed
    grouped = n_group > 1 and topk_group < n_group
    assert not grouped or (e == triton.next_power_of_2(e) and n_group == triton.next_power_of_2(n_group)
                           and e % n_group == 0), "grouped routing needs power-of-two experts and groups"
    weights = torch.empty(t, width, dtype=x.dtype, device=x.device)
    ids = torch.empty(t, width, dtype=torch.int64, device=x.device)
    logits = torch.empty(t, e_tot, dtype=torch.float32, device=x.device)
    block_t = triton.next_power_of_2(t)
    # ~130 programs for 513 router rows: one 16 KB load per program at T = 1; small routers (DeepSeek-V2-Lite's
    # 64 fp32 rows) take 2 rows per program, so >= 32 programs share the read instead of 16
    block_e = block_e or (4 if e_tot >= 256 else 2)
    block_all = triton.next_power_of_2(e)
    per_program = 8192 if warps is None else 2048 * warps  # elements of one router tile: ~64 per thread at 4 warps
    warps = warps or (8 if block_t * block_all >= 4096 else 4)
    block_k = min(triton.next_power_of_2(h), max(64, per_program // (block_t * block_e)))
    _route_kernel[(triton.cdiv(e_tot, block_e),)](
        x, gate_weight, bias if bias is not None else logits, logits, counter, weights, ids, t, e, h, x.stride(0),
        gate_weight.stride(0), float(scale), TOP_K=top_k, SHARED=int(shared), FIXED=fixed, BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_K=block_k, BLOCK_ALL=block_all, BLOCK_SLOT=triton.next_power_of_2(width),
        SIGMOID=score == "sigmoid", HAS_BIAS=bias is not None, RENORM=bool(renormalize), ROUND=bool(round_logits),
        N_GROUP=n_group if grouped else 1, TOPK_GROUP=topk_group, GROUP_TOP2=bool(group_top2),
        num_warps=warps, **pdl_args(pdl, x.device))
    return weights, ids


def gate_up_pairs_triton(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """inter [T*S, I] = silu(gate) * up of every (token, slot) pair, by triton_moe's per-pair GEMV."""
    t, h = x.shape
    inter_size = w13.shape[1] // 2
    s = ids.shape[1]
    inter = torch.empty(t * s, inter_size, dtype=x.dtype, device=x.device)
    bk = triton.next_power_of_2(h)  # whole rows in one load per program (see triton_moe._fused_moe_gemv)
    bn = max(1, min(16, 16384 // bk))
    _gemv1_kernel[(t * s, triton.cdiv(inter_size, bn))](
        x, w13, inter, ids.reshape(-1), s, w13.shape[0], inter_size, h, x.stride(0), w13.stride(0), w13.stride(1),
        inter.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, num_warps=8)
    return inter


def down_sum_triton(inter: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    block_n: int = 4, block_k: int | None = None, warps: int = 4) -> torch.Tensor:
    """inter [T*S, I], w2 [E, H, I], weights/ids [T, S] -> out [T, H] in inter's dtype (moe_decode.down_sum_ref)."""
    t, s = ids.shape
    _, h, inter_size = w2.shape
    assert inter.shape == (t * s, inter_size) and inter.stride(-1) == 1 and w2.stride(-1) == 1
    ids, weights = ids.contiguous(), weights.contiguous()
    out = torch.empty(t, h, dtype=inter.dtype, device=inter.device)
    block_s = triton.next_power_of_2(s)
    block_k = block_k or min(triton.next_power_of_2(inter_size), max(32, 8192 // (block_s * block_n)))
    _down_sum_kernel[(t, triton.cdiv(h, block_n))](
        inter, w2, out, ids, weights, s, h, inter_size, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_S=block_s, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


def experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   tiles: ExpertTiles = DEFAULT_TILES) -> torch.Tensor:
    """gate|up then down+sum for routed (weights, ids) [T, S]: two launches, out [T, H] in x's dtype."""
    assert tiles.gate_up in ("pair", "stream") and tiles.down in ("sum", "stream")
    # fp32 doubles the stream tiles' registers (not swept): the one-shot kernels there
    wide = x.dtype == torch.float32 or 2 * tiles.gu_block_n * triton.next_power_of_2(x.shape[1]) > STREAM_TILE_MAX
    if tiles.gate_up == "stream" and not wide:
        inter = gate_up_stream(x, w13, ids, tiles.gu_block_n, tiles.gu_warps, tiles.gu_per_sm, tiles.pdl)
    else:
        inter = gate_up_pairs_triton(x, w13, ids)
    block_s, block_k = triton.next_power_of_2(ids.shape[1]), triton.next_power_of_2(w2.shape[2])
    if tiles.down == "stream" and block_s * tiles.down_block_n * block_k <= STREAM_TILE_MAX and \
            x.dtype != torch.float32:
        return down_stream(inter, w2, weights, ids, tiles.down_block_n, tiles.down_warps, tiles.down_per_sm,
                           tiles.pdl)
    if tiles.down == "stream":  # a tile too wide for the registers: the looped kernel's measured best tile
        return down_sum_triton(inter, w2, weights, ids, block_n=8, block_k=128, warps=4)
    return down_sum_triton(inter, w2, weights, ids, tiles.down_block_n, tiles.down_block_k, tiles.down_warps)


def moe_decode_triton(x: torch.Tensor, gate_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
                      renormalize: bool, shared: bool, counter: torch.Tensor, score: str = "softmax",
                      bias: torch.Tensor | None = None, tiles: ExpertTiles = DEFAULT_TILES,
                      **routing) -> torch.Tensor:
    """The whole routed-expert block for T <= MAX_TOKENS tokens in three launches: route, gate|up, down+sum.
    routing: route_triton's keywords (round_logits, scale, fixed, n_group, topk_group, group_top2)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    weights, ids = route_triton(x, gate_weight, top_k, renormalize, shared, counter, score, bias, **routing,
                                warps=tiles.route_warps, pdl=tiles.pdl)
    return experts_triton(x, w13, w2, weights, ids, tiles)
