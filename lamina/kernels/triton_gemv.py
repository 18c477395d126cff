"""Decode GEMV / skinny GEMM: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M = 1..16, weight-bandwidth bound.

At decode the activations are a few rows and the weights are read once per step, so the kernel's only job is
to stream W at copy bandwidth: each program owns BLOCK_N weight rows and a 1/SPLIT_K share of K, loops over
[BLOCK_N, BLOCK_K] tiles (software-pipelined, num_stages deep) and keeps an fp32 [BLOCK_M, BLOCK_N]
accumulator. Two inner products: `dot` pads M to 16 and uses the tensor cores (mma), so 16 rows cost no more
than one; `fma` multiplies on the CUDA cores with BLOCK_M = M rounded up (1, 2 or 4), no padding.

Split-K (small N, long K): each split writes its fp32 partial tile to a workspace and bumps a per-N-block
counter (acq_rel atomic after a CTA barrier); the program that arrives last sums the SPLIT_K partials in a
fixed order (deterministic), adds the bias, writes y and resets the counter to 0, so the next launch (or a
CUDA-graph replay) finds it zeroed. One launch, no memset, no host sync; the grid comes from host shapes.

Config choice: `candidate_configs` lists a few tiles per (M, N, K); GemvDispatcher times them once per shape
on the first CUDA call (CUDA-graph replays with an L2 flush in between, so weights come from HBM as at
decode) and keeps the winner and the split-K workspaces in dicts it owns. While a graph is being captured it
uses the heuristic pick with no split (it cannot time or allocate there). Interpreter caveat: bf16 `tl.dot`
is wrong under TRITON_INTERPRET (raw bits), so CPU tests check the dot configs in fp16/fp32 only.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from lamina.kernels.gemv_fusion import Epilogue, Prologue  # noqa: F401 - the fusions' descriptions, re-exported

MAX_M = 16  # the dispatcher (gemv.py) sends at most this many rows here


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, r_ptr, s_ptr, nw_ptr, eps, nw_off, M, N, K,
                 stride_xm, stride_rm, stride_sm, stride_wn, stride_ym, k_per_split, h_ptr, stride_hm,
                 BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr = False,
                 PREFETCH_K: tl.constexpr = 0, LINE: tl.constexpr = 64, PRO: tl.constexpr = 0,
                 EPI: tl.constexpr = 0, BLOCK_R: tl.constexpr = 16, BLOCK_B: tl.constexpr = 16):
    # PRO (prologue on x, see Prologue): 0 none; 1 RMSNorm; 2 residual add + RMSNorm (program (0, k) writes
    # its K share of the sum to s_ptr); 3 SiLU(gate) * up, 4 tanh-GELU(gate) * up (x: [M, 2K], gate first).
    # The norm's 1/rms is a per-row scalar: each program sums squares over its own K share in the main loop
    # and scales the accumulator at the end (split-K: the partial sums of squares travel with the partials),
    # so no program reads more of x than without the prologue and no extra pass over x is needed.
    # EPI (epilogue on y, see Epilogue; PRO must be 0): 1 SiLU(gate) * up, 2 tanh-GELU(gate) * up (W: [2N, K]
    # gate rows then up rows; each program owns rows n of both halves, SPLIT_K 1); 3 residual add + RMSNorm
    # of the whole output row: y_ptr gets y + residual (r_ptr), h_ptr its norm (see _add_norm_epilogue).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    if PDL:  # launched with programmatic dependent launch: may start before the previous kernel has finished
        if PREFETCH_K > 0:  # weights never depend on it: pull the first columns of our rows into L2 meanwhile
            cols = k_start + tl.arange(0, PREFETCH_K // LINE) * LINE  # one address per 128-byte line
            pf = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + cols[None, :]
            pf = tl.where(n_ok[:, None] & (cols < k_end)[None, :], pf, w_ptr)  # in bounds: a valid address
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [pf], dtype=tl.int32, is_pure=False,
                                      pack=1)
        gdc_launch_dependents()
        gdc_wait()  # x (and y, the workspace) belong to the previous kernels: wait for them to finish
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # EPI 1/2: the up half's rows (dead code else)
    up_off = N.to(tl.int64) * stride_wn
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    writer = pid_n == 0  # the programs of the first N block write the residual sum (disjoint K shares)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:  # no mask along K: the loads stay 16-byte vectors
            xm = m_ok[:, None]
            wmask = n_ok[:, None]
        else:
            k_ok = (k0 + offs_k) < k_end
            xm = m_ok[:, None] & k_ok[None, :]
            wmask = n_ok[:, None] & k_ok[None, :]
        wt = tl.load(w_ptrs, mask=wmask, other=0.0)
        xt = tl.load(x_ptrs, mask=xm, other=0.0)
        if PRO == 1 or PRO == 2:
            if PRO == 2:  # x + residual rounded to the stream dtype, as the unfused add rounds it
                rt = tl.load(r_ptr + offs_m[:, None] * stride_rm + (k0 + offs_k)[None, :], mask=xm, other=0.0)
                xt = (xt.to(tl.float32) + rt.to(tl.float32)).to(x_ptr.dtype.element_ty)
                tl.store(s_ptr + offs_m[:, None] * stride_sm + (k0 + offs_k)[None, :], xt, mask=xm & writer)
            xf = xt.to(tl.float32)
            sumsq += tl.sum(xf * xf, axis=1)
            nw = tl.load(nw_ptr + k0 + offs_k, mask=(k0 + offs_k) < k_end, other=0.0).to(tl.float32) + nw_off
            xt = (xf * nw[None, :]).to(x_ptr.dtype.element_ty)
        elif PRO == 3 or PRO == 4:
            gate = xt.to(tl.float32)
            up = tl.load(x_ptrs + K, mask=xm, other=0.0).to(tl.float32)
            if PRO == 4:  # 0.5 g (1 + tanh(u)) = g * sigmoid(2u), as triton_activation computes it
                u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
                xt = (gate / (1.0 + tl.exp(-2.0 * u)) * up).to(x_ptr.dtype.element_ty)
            else:
                xt = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty)
        if USE_DOT:
            acc += tl.dot(xt, tl.trans(wt), input_precision=DOT_PREC)
        else:
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
        if EPI == 1 or EPI == 2:
            wu = tl.load(w_ptrs + up_off, mask=wmask, other=0.0)
            if USE_DOT:
                acc_up += tl.dot(xt, tl.trans(wu), input_precision=DOT_PREC)
            else:
                acc_up += tl.sum(xt.to(tl.float32)[:, None, :] * wu.to(tl.float32)[None, :, :], axis=2)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if PRO == 1 or PRO == 2:
            acc = acc * (1.0 / tl.sqrt(sumsq / K + eps))[:, None]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if EPI == 1 or EPI == 2:  # gate and up rounded to the output dtype first, as the unfused GEMV rounds
            if HAS_BIAS:
                acc_up += tl.load(b_ptr + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            up = acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)
            if EPI == 2:
                u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
                acc = gate / (1.0 + tl.exp(-2.0 * u)) * up
            else:
                acc = gate / (1.0 + tl.exp(-gate)) * up
        if EPI == 3:
            _add_norm_epilogue(acc, y_ptr, r_ptr, h_ptr, nw_ptr, part_ptr, cnt_ptr, eps, nw_off, M, N, stride_ym,
                               stride_rm, stride_hm, offs_m, offs_n, y_mask, pid_n, tl.num_programs(0), 0,
                               BLOCK_M, BLOCK_R, BLOCK_B)
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tile = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        n_blocks = tl.num_programs(0)
        tl.store(part_ptr + (pid_k * n_blocks + pid_n).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile, acc)
        ss_ptr = part_ptr + SPLIT_K * n_blocks * (BLOCK_M * BLOCK_N)  # [SPLIT_K, n_blocks, BLOCK_M] after them
        if PRO == 1 or PRO == 2:
            tl.store(ss_ptr + (pid_k * n_blocks + pid_n) * BLOCK_M + offs_m, sumsq)
        tl.debug_barrier()  # every thread's partial is issued before the counter is released
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this N block reduces
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            total_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + (s * n_blocks + pid_n).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile,
                                 cache_modifier=".cg")
                if PRO == 1 or PRO == 2:
                    total_ss += tl.load(ss_ptr + (s * n_blocks + pid_n) * BLOCK_M + offs_m, cache_modifier=".cg")
            if PRO == 1 or PRO == 2:
                total = total * (1.0 / tl.sqrt(total_ss / K + eps))[:, None]
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            if EPI == 3:
                _add_norm_epilogue(total, y_ptr, r_ptr, h_ptr, nw_ptr, part_ptr, cnt_ptr + n_blocks, eps, nw_off, M,
                                   N, stride_ym, stride_rm, stride_hm, offs_m, offs_n, y_mask, pid_n, n_blocks,
                                   SPLIT_K * n_blocks * (BLOCK_M * (BLOCK_N + 1)), BLOCK_M, BLOCK_R, BLOCK_B)
            else:
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _add_norm_epilogue(acc, y_ptr, r_ptr, h_ptr, nw_ptr, part_ptr, cnt_ptr, eps, nw_off, M, N, stride_ym,
                       stride_rm, stride_hm, offs_m, offs_n, y_mask, pid_n, n_blocks, ss_off,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """The add + RMSNorm that follows a projection, done by the projection's own programs: each writes its
    tile of s = y + residual (y rounded first, as the unfused GEMV writes it) and the tile's sum of squares,
    then arrives at one counter; the last program to arrive sums the n_blocks partial sums in a fixed order
    (deterministic: graph replays equal eager) and writes the whole rows' h = s * rstd * (w + offset), read
    back from L2 (.cg). It resets the counter, so a replay finds it zero. The rows are a few KB: one program
    reads them in a few loads, cheaper than the launch and ramp of a separate norm kernel."""
    ss_ptr = part_ptr + ss_off  # [n_blocks, BLOCK_M] fp32 after any split-K partials
    yb = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    rt = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=y_mask, other=0.0).to(tl.float32)
    st = (yb + rt).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], st, mask=y_mask)
    sf = tl.where(y_mask, st.to(tl.float32), 0.0)
    tl.store(ss_ptr + pid_n * BLOCK_M + offs_m, tl.sum(sf * sf, axis=1))
    tl.debug_barrier()  # this program's s tile and partial are issued before it arrives
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == n_blocks - 1:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for b0 in range(0, n_blocks, BLOCK_B):
            blk = b0 + tl.arange(0, BLOCK_B)
            part = tl.load(ss_ptr + blk[:, None] * BLOCK_M + offs_m[None, :], mask=(blk < n_blocks)[:, None],
                           other=0.0, cache_modifier=".cg")
            ss += tl.sum(part, axis=0)
        rstd = tl.math.rsqrt(ss / N + eps)
        cols = tl.arange(0, BLOCK_R)
        for m in range(M):
            r_m = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
            for n0 in range(0, N, BLOCK_R):
                c_ok = (n0 + cols) < N
                s = tl.load(y_ptr + m * stride_ym + n0 + cols, mask=c_ok, other=0.0, cache_modifier=".cg")
                w = tl.load(nw_ptr + n0 + cols, mask=c_ok, other=0.0).to(tl.float32) + nw_off
                tl.store(h_ptr + m * stride_hm + n0 + cols, ((s.to(tl.float32) * r_m) * w).to(
                    h_ptr.dtype.element_ty), mask=c_ok)
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    dot: bool = True
    # Programmatic dependent launch (sm_90+): the launch may overlap the previous kernel's tail; the program
    # prefetches its first `prefetch_k` weight columns into L2, then waits for the previous kernel before
    # reading x. Only worth it in chains of PDL-aware kernels; never picked by the single-kernel tuning.
    pdl: bool = False
    prefetch_k: int = 0

    def block_m(self, m: int) -> int:
        return 16 if self.dot else triton.next_power_of_2(m)

    def label(self) -> str:
        pdl = f" pdl{self.prefetch_k}" if self.pdl else ""
        return (f"{'dot' if self.dot else 'fma'} n{self.block_n} k{self.block_k} s{self.split_k} "
                f"w{self.warps} st{self.stages}{pdl}")


# Tiles per inner product: dot pads M to 16 (tensor cores); fma keeps M (<= 4) and multiplies on CUDA cores,
# register use ~ BLOCK_M * BLOCK_N * BLOCK_K / threads. H200 run of 2026-12-01 (Qwen3-8B shapes, M = 1..16):
# the winners were dot n32 k256 (qkv, o, down), dot n64 k128 (gate_up, lm_head) and fma n4 k1024 (o, down at
# M = 1); n16 tiles and the 4-16-way splits always lost. Small matrices sat ~4 us above bytes / 4.5 TB/s:
# ramp-up and tail with one or two programs per SM. Hence the wider-K / deeper-stage variants and 2-way
# splits (two programs per SM on N = 4096) added here, and the PDL variant for chains.
_DOT_TILES = [(32, 256, 4, 4), (64, 128, 4, 4), (32, 512, 4, 3), (64, 256, 8, 3), (32, 128, 4, 6), (16, 256, 4, 4)]
_DOT_FEW_ROWS = 2  # with M <= 4 only the first two dot tiles join the fma ones (bounded tuning time)
_FMA_TILES = [(4, 1024, 4, 3), (2, 2048, 4, 2), (8, 512, 4, 3), (4, 2048, 8, 2)]
# Whole 4096-wide rows in one load (1-2 rows of x only: registers): every byte of a program in flight at once,
# the layout that took the MoE expert GEMVs from 1.8 to 3.0 TB/s (GPU_KERNELS.md).
_FMA_WIDE = (2, 4096, 8, 1)


def auto_split(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """Power-of-two split of K so that about four programs run per SM, each with >= 2 K tiles, at most 16."""
    n_blocks = triton.cdiv(n, block_n)
    split = 1
    while split < 16 and n_blocks * split < 4 * num_sms and k // (2 * split) >= 2 * block_k:
        split *= 2
    return split


def candidate_configs(m: int, n: int, k: int, num_sms: int) -> list[GemvConfig]:
    """The configs timed for one shape: each tile without split, split in two where K holds >= 4 tiles, and
    auto_split's split where N alone gives fewer programs than SMs (deduplicated; at most 16)."""
    tiles = [(t, True) for t in _DOT_TILES]
    if m <= 4:
        tiles = [(t, False) for t in _FMA_TILES + ([_FMA_WIDE] if m <= 2 else [])] + tiles[:_DOT_FEW_ROWS]
    levels: list[list[GemvConfig]] = [[], [], []]  # unsplit first, then 2-way, then auto: the cap drops splits
    for (bn, bk, warps, stages), dot in tiles:
        bk = min(bk, max(16, triton.next_power_of_2(k)))
        levels[0].append(GemvConfig(bn, bk, 1, warps, stages, dot))
        if k >= 4 * bk and triton.cdiv(n, bn) < 4 * num_sms:  # a long matrix has programs enough
            levels[1].append(GemvConfig(bn, bk, 2, warps, stages, dot))
        if triton.cdiv(n, bn) < num_sms:
            levels[2].append(GemvConfig(bn, bk, auto_split(n, k, bn, bk, num_sms), warps, stages, dot))
    out: list[GemvConfig] = []
    for cfg in levels[0] + levels[1] + levels[2]:
        if cfg not in out:
            out.append(cfg)
    return out[:16]


def heuristic_config(m: int, n: int, k: int, num_sms: int, allow_split: bool = True) -> GemvConfig:
    """The untimed pick, from the H200 winners: fma n4 k1024 for 1-2 rows, dot n32 k256 above (n64 k128 where
    N gives >= 3 programs per SM); split-K only where N alone gives too few programs."""
    if m <= 2:
        bn, bk, warps, stages = _FMA_TILES[0]
    else:
        bn, bk, warps, stages = _DOT_TILES[1] if triton.cdiv(n, 64) >= 3 * num_sms else _DOT_TILES[0]
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    split = auto_split(n, k, bn, bk, num_sms) if allow_split and triton.cdiv(n, bn) < num_sms else 1
    return GemvConfig(bn, bk, split, warps, stages, dot=m > 2)


def workspace_shape(m: int, n: int, cfg: GemvConfig, epilogue: str | None = None) -> tuple[int, int]:
    """(fp32 partial elements, int32 counters) a launch needs: split-K partials and one counter per N block;
    an add_norm epilogue adds one sum of squares per N block and row, and one counter. (0, 0): none."""
    n_blocks = triton.cdiv(n, cfg.block_n)
    parts = counters = 0
    if cfg.split_k > 1:  # partial tiles, then a norm prologue's partial sums of squares
        parts, counters = cfg.split_k * n_blocks * cfg.block_m(m) * (cfg.block_n + 1), n_blocks
    if epilogue == "add_norm":
        parts, counters = parts + n_blocks * cfg.block_m(m), counters + 1
    return parts, counters


def needs_workspace(cfg: GemvConfig, epilogue: str | None = None) -> bool:
    return cfg.split_k > 1 or epilogue == "add_norm"


def new_workspace(m: int, n: int, cfg: GemvConfig, device: torch.device,
                  epilogue: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    parts, counters = workspace_shape(m, n, cfg, epilogue)
    return (torch.empty(max(parts, 1), dtype=torch.float32, device=device),
            torch.zeros(max(counters, 1), dtype=torch.int32, device=device))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None,
         workspace: tuple[torch.Tensor, torch.Tensor] | None = None, *, out: torch.Tensor | None = None,
         num_sms: int | None = None, prologue: Prologue | None = None,
         epilogue: Epilogue | None = None) -> torch.Tensor:
    """y = epi(pro(x) @ weight.T + bias). x: [M, K] (M <= 16, unit stride on K; [M, 2K] for an activation
    prologue), weight: [N, K] contiguous rows ([2N, K] for an activation epilogue), same dtype as x; bias
    [N] ([2N]) or None. Without `config` the heuristic pick is used; a split-K config or an add_norm
    epilogue needs a workspace (new_workspace; counters zero, which every launch leaves them) or gets a fresh
    one. prologue: see Prologue, epilogue: see Epilogue (at most one of the two)."""
    m = x.shape[0]
    n, k = weight.shape
    pro = prologue.code if prologue is not None else 0
    epi = epilogue.code if epilogue is not None else 0
    assert not (pro and epi), "a prologue or an epilogue, not both"
    if epi in (1, 2):
        assert n % 2 == 0 and (config is None or config.split_k == 1), "an activation epilogue takes no split"
        n //= 2
    assert 1 <= m <= MAX_M and x.shape[1] == (2 * k if pro >= 3 else k) and x.dtype == weight.dtype
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    if config is None:
        config = heuristic_config(m, n, k, num_sms or _num_sms(x.device), allow_split=epi not in (1, 2))
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    epi_kind = epilogue.kind if epilogue is not None else None
    if needs_workspace(config, epi_kind) and workspace is None:
        workspace = new_workspace(m, n, config, x.device, epi_kind)
    parts, counters = workspace if needs_workspace(config, epi_kind) else (out, out)
    res = sums = norm_w = normed = x
    eps, off = 0.0, 0.0
    if epi == 3:
        norm_w, eps, off = epilogue.weight, float(epilogue.eps), float(epilogue.offset)
        res, normed = epilogue.residual, epilogue.norm_out
        assert norm_w.shape == (n,) and norm_w.is_contiguous() and res.shape == out.shape == normed.shape
        assert res.stride(-1) == 1 and normed.stride(-1) == 1 and out.stride(-1) == 1
    if pro in (1, 2):
        norm_w, eps, off = prologue.weight, float(prologue.eps), float(prologue.offset)
        assert norm_w.shape == (k,) and norm_w.is_contiguous()
    if pro == 2:
        res, sums = prologue.residual, prologue.sum_out
        assert res.shape == x.shape and sums.shape == x.shape and res.stride(-1) == 1 and sums.stride(-1) == 1
    bk = config.block_k
    k_per_split = triton.cdiv(triton.cdiv(k, bk), config.split_k) * bk
    grid = (triton.cdiv(n, config.block_n), config.split_k)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else out, out, parts, counters, res, sums, norm_w, eps, off, m, n, k,
        x.stride(0), res.stride(0), sums.stride(0), weight.stride(0), out.stride(0), k_per_split, normed,
        normed.stride(0), BLOCK_M=config.block_m(m), BLOCK_N=config.block_n, BLOCK_K=bk, SPLIT_K=config.split_k,
        USE_DOT=config.dot,
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.warps, num_stages=config.stages, PRO=pro, EPI=epi, **_epi_blocks(epi, m, n, config),
        **_pdl_args(config, x.element_size()))
    return out


def _epi_blocks(epi: int, m: int, n: int, config: GemvConfig) -> dict:
    """The add_norm tail's tiles: row chunks of <= 2048 (registers: the tail shares the kernel's budget)
    and partial sums read <= 4096 at a time."""
    if epi != 3:
        return {}
    bm, n_blocks = config.block_m(m), triton.cdiv(n, config.block_n)
    return dict(BLOCK_R=min(2048, triton.next_power_of_2(n)),
                BLOCK_B=min(triton.next_power_of_2(n_blocks), max(1, 4096 // bm)))


def _pdl_args(config: GemvConfig, elem_bytes: int) -> dict:
    """Launch options of a PDL config (none otherwise, so interpreter launches never see them)."""
    if not config.pdl:
        return {}
    line = 128 // elem_bytes
    lines = config.prefetch_k // line
    lines = 1 << (lines.bit_length() - 1) if lines else 0  # a power of two (tl.arange)
    return dict(PDL=True, PREFETCH_K=lines * line, LINE=line, launch_pdl=True)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200's count: interpreter runs pick the same configs as the GPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def _bucket(m: int) -> int:
    return triton.next_power_of_2(m)
