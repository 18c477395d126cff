"""Streaming variants of the MoE decode expert kernels (gate|up per pair, down with the sum over a token's
experts folded in): a persistent grid of a few programs per SM, each walking tiles pid, pid + P, pid + 2P, ...
and loading the next tile's weights before it reduces the current one, so every program keeps two tiles of
weight bytes in flight without waiting on its own reduction and store (torch references in moe_decode.py).

Why (H200, Qwen3-Next layer at T = 1, 2026-12-01e gpu_fusion_bench): the one-shot per-pair GEMV of gate|up
(704 programs of 8 whole 2048-long rows x 2, 8 warps) read 46 MB in 14.9 us = 3.1 TB/s, 73% of copy bandwidth,
and the down+sum kernel (512 programs of [16 slots, 4 rows, 128] tiles looped over K) 23 MB in 15.3 us
= 36% (its best tile, n2 k256, 2.3 TB/s). A one-shot program issues its loads, then waits, reduces and stores
with nothing in flight, and 704 programs are 2.7 waves of ~2 resident programs per SM (a third of the last
wave idle). Here the grid is exactly `per_sm` programs per SM, tiles are small (2-4 rows: 2,816 gate|up
tiles and 1,024 down tiles at T = 1) so the last round is nearly full, and the load of tile i + 1 is issued
before the reduction of tile i.

Tiles. gate|up: tile = (pair, BLOCK_N rows of I), pair-major so neighbouring programs read neighbouring rows
of one expert; whole K = H per tile. down: tile = (token, BLOCK_N output columns of H); all S slots' rows
([BLOCK_S, BLOCK_N, BLOCK_K], padded slots masked: no bytes) and whole K = I per tile, weighted sum over the
slots in registers in a fixed order, so the output is deterministic and needs no atomics. Grids come from
host shapes and the SM count only: graph-capture safe. PDL (optional, off by default until measured): the
kernel is launched before its predecessor ends and waits (griddepcontrol.wait) before its first load, which
hides the launch gap between the three MoE launches (the route kernel takes the same flag).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _gu_load(x_ptr, w_ptr, ids_ptr, tile, n_tiles, n_blocks, S, N, K, stride_xm, stride_we, stride_wn,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    live = tile < n_tiles
    pair = tl.where(live, tile // n_blocks, 0).to(tl.int64)
    offs_n = (tile % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    m = live & (offs_n < N)[:, None] & k_ok[None, :]
    g_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    g = tl.load(g_ptrs, mask=m, other=0.0)
    u = tl.load(g_ptrs + N * stride_wn, mask=m, other=0.0)
    xv = tl.load(x_ptr + (pair // S) * stride_xm + offs_k, mask=live & k_ok, other=0.0)
    return g, u, xv


@triton.jit
def _gate_up_stream_kernel(x_ptr, w_ptr, out_ptr, ids_ptr, S, N, K, stride_xm, stride_we, stride_wn, stride_om,
                           n_tiles, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """inter[pair, n] = silu(x[tok] . w[e, n]) * (x[tok] . w[e, N + n]), pair = tok * S + slot, e = ids[pair]."""
    if PDL:  # launched early (programmatic dependent launch): ids and x are the previous kernels' outputs
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    g, u, xv = _gu_load(x_ptr, w_ptr, ids_ptr, pid, n_tiles, n_blocks, S, N, K, stride_xm, stride_we, stride_wn,
                        BLOCK_N, BLOCK_K)
    for tile in range(pid, n_tiles, step):
        g2, u2, x2 = _gu_load(x_ptr, w_ptr, ids_ptr, tile + step, n_tiles, n_blocks, S, N, K, stride_xm, stride_we,
                              stride_wn, BLOCK_N, BLOCK_K)  # in flight while this tile is reduced
        xf = xv.to(tl.float32)[None, :]
        acc_g = tl.sum(g.to(tl.float32) * xf, 1)
        acc_u = tl.sum(u.to(tl.float32) * xf, 1)
        y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        offs_n = (tile % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + (tile // n_blocks).to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty),
                 mask=offs_n < N)
        g, u, xv = g2, u2, x2


@triton.jit
def _down_load(a_ptr, w_ptr, ids_ptr, wts_ptr, tile, n_tiles, n_blocks, S, N, K, stride_am, stride_we, stride_wn,
               BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    live = tile < n_tiles
    t = tl.where(live, tile // n_blocks, 0).to(tl.int64)
    offs_n = (tile % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.arange(0, BLOCK_S)
    s_ok = live & (s < S)
    pair = t * S + s
    e = tl.load(ids_ptr + pair, mask=s_ok, other=0).to(tl.int64)
    wt = tl.load(wts_ptr + pair, mask=s_ok, other=0.0)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    a = tl.load(a_ptr + pair[:, None] * stride_am + offs_k[None, :], mask=s_ok[:, None] & k_ok[None, :], other=0.0)
    w_ptrs = w_ptr + e[:, None, None] * stride_we + offs_n[None, :, None].to(tl.int64) * stride_wn + \
        offs_k[None, None, :]
    w = tl.load(w_ptrs, mask=s_ok[:, None, None] & (offs_n < N)[None, :, None] & k_ok[None, None, :], other=0.0)
    return w, a, wt


@triton.jit
def _down_stream_kernel(a_ptr, w_ptr, out_ptr, ids_ptr, wts_ptr, S, N, K, stride_am, stride_we, stride_wn,
                        stride_om, n_tiles, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr = False):
    """out[t, n] = sum_s weight[t, s] * (inter[t*S + s] . w2[ids[t, s], n]), slots summed in registers."""
    if PDL:  # inter is the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    w, a, wt = _down_load(a_ptr, w_ptr, ids_ptr, wts_ptr, pid, n_tiles, n_blocks, S, N, K, stride_am, stride_we,
                          stride_wn, BLOCK_S, BLOCK_N, BLOCK_K)
    for tile in range(pid, n_tiles, step):
        w2, a2, wt2 = _down_load(a_ptr, w_ptr, ids_ptr, wts_ptr, tile + step, n_tiles, n_blocks, S, N, K, stride_am,
                                 stride_we, stride_wn, BLOCK_S, BLOCK_N, BLOCK_K)  # in flight during the sums
        acc = tl.sum(w.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2)  # [BLOCK_S, BLOCK_N]
        y = tl.sum(acc * wt.to(tl.float32)[:, None], axis=0)
        offs_n = (tile % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + (tile // n_blocks).to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty),
                 mask=offs_n < N)
        w, a, wt = w2, a2, wt2


def pdl_args(pdl: bool, device: torch.device) -> dict:
    """Launch options for programmatic dependent launch (none on the CPU: the interpreter has no griddepcontrol)."""
    return dict(PDL=True, launch_pdl=True) if pdl and device.type == "cuda" else {}


def stream_programs(device: torch.device, n_tiles: int, per_sm: int) -> int:
    """The persistent grid: per_sm programs per SM (4 on a CPU tensor, so the interpreter walks several tiles
    per program), never more than there are tiles."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(n_tiles, sms * per_sm if device.type == "cuda" else 4))


def gate_up_stream(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, block_n: int = 4, warps: int = 8,
                   per_sm: int = 2, pdl: bool = False) -> torch.Tensor:
    """inter [T*S, I] = silu(gate) * up of every (token, slot) pair (moe_decode.gate_up_pairs_ref)."""
    t, h = x.shape
    inter_size = w13.shape[1] // 2
    s = ids.shape[1]
    assert x.stride(-1) == 1 and w13.stride(-1) == 1
    ids = ids.reshape(-1).contiguous()
    inter = torch.empty(t * s, inter_size, dtype=x.dtype, device=x.device)
    n_tiles = t * s * triton.cdiv(inter_size, block_n)
    _gate_up_stream_kernel[(stream_programs(x.device, n_tiles, per_sm),)](
        x, w13, inter, ids, s, inter_size, h, x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0), n_tiles,
        BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(h), num_warps=warps, **pdl_args(pdl, x.device))
    return inter


def down_stream(inter: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, block_n: int = 2,
                warps: int = 8, per_sm: int = 2, pdl: bool = False) -> torch.Tensor:
    """inter [T*S, I], w2 [E, H, I], weights/ids [T, S] -> out [T, H] in inter's dtype (moe_decode.down_sum_ref)."""
    t, s = ids.shape
    _, h, inter_size = w2.shape
    assert inter.shape == (t * s, inter_size) and inter.stride(-1) == 1 and w2.stride(-1) == 1
    ids, weights = ids.contiguous(), weights.contiguous()
    out = torch.empty(t, h, dtype=inter.dtype, device=inter.device)
    n_tiles = t * triton.cdiv(h, block_n)
    _down_stream_kernel[(stream_programs(inter.device, n_tiles, per_sm),)](
        inter, w2, out, ids, weights, s, h, inter_size, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        n_tiles, BLOCK_S=triton.next_power_of_2(s), BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(inter_size),
        num_warps=warps, **pdl_args(pdl, inter.device))
    return out
