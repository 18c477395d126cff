"""Which Triton kernel serves a weight-quantized linear on CUDA, by rows of x (M), and the once-per-shape
timing that refines the pick (the bf16 GEMV dispatcher's tuner, gemv.rank_configs).

Paths ("kn" needs the repacked copy, LAMINA_WQ_GEMV=repack; "old" is the [N, K/2] layout every weight has):
- kn:     triton_wq_gemv_kn.kn_gemv, KnConfig.rows = 1 (a program per row) or > 1 (rows share each word).
- gemv:   triton_wq_matmul's GEMV (a program per row).
- dot:    triton_wq_matmul's tensor-core tile (dot_join), BLOCK_M = 16 for M <= 16.

Untimed picks (heuristic_path), from the H200 night of 2026-12-02 (Qwen3-8B shapes, 36 weights per graph,
benchmarks/results/2026-12-02d/call7/night/wqkn.log):

    M        | with the kn copy                              | old layout only
    ---------+-----------------------------------------------+-------------------------------
    1        | kn, kn_m1_config (qkv 10.3, o 9.8, gate_up    | gemv (wq_matmul's heuristic)
             | 24.6, down 16.8 us; kn default 13.7/12.2/35.0/ |
             | 22.6; old gemv 13.8/9.9/40.6/24.5)             |
    2..16    | dot, BLOCK_M = 16 (M = 16: qkv 18.1 us; the   | dot, BLOCK_M = 16
             | one-row GEMVs at M = 4: kn 37.6, old 42.6);   |
             | since the H100 run of 2026-12-07 (wqkn) with  |
             | 256-wide K steps, the tuner's pick there      |
    > 16     | dot (prefill tiles; kn_matmul: 48 vs 343 TF/s) | dot

Timed (LAMINA_WQ_TUNE=1; off by default until the GPU numbers say the start-up compiles pay): once per
(M bucket, N, K, group, bits, dtype, device, kn or not), on the first call outside CUDA-graph capture (the
engine's eager warm-up), the untimed pick and candidates_for's list, each checked against the dequantized
weight's matmul first. M = 2..16 with the kn copy adds the multi-row kn GEMV (not yet measured on a GPU: it
is picked only where it times faster).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton

from lamina.kernels.triton_wq_gemv_kn import KnConfig, KnWeight, kn_gemv
from lamina.kernels.triton_wq_matmul import WqConfig, heuristic_config, wq_matmul

TUNE_SWITCH = "LAMINA_WQ_TUNE"  # "1": time the candidates once per shape (off by default: start-up compiles)
MAX_DECODE = 16  # rows up to which the decode candidates are timed (above: the prefill heuristic, untimed)


@dataclass(frozen=True)
class WqPath:
    kind: str  # "kn" | "old" (wq_matmul: its config says gemv or dot)
    cfg: KnConfig | WqConfig

    def label(self) -> str:
        c = self.cfg
        if self.kind == "kn":
            return f"kn r{c.rows} n{c.block_n} kw{c.block_kw} s{c.split_k} w{c.num_warps} v{c.waves}"
        return f"{c.kernel} m{c.block_m} n{c.block_n} k{c.block_k} s{c.split_k} w{c.num_warps} st{c.num_stages}"


def run_path(path: WqPath, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
             bits: int, kn: KnWeight | None, sms: int | None = None) -> torch.Tensor:
    if path.kind == "kn":
        return kn_gemv(x, kn, path.cfg, sms=sms)
    return wq_matmul(x, qweight, scales, offsets, bits, path.cfg)


def kn_m1_config(n: int, k: int) -> KnConfig:
    """The batch-1 kn config. 128 columns x 32 words was the best or within 0.2 us of it on qkv, o and
    gate_up (g128 and g32); the down projection (K = 3 N: few tiles, long K) took 256 x 16 at 3 waves
    (16.8 us against 19.3 for 128 x 32). Both plans give ~2.9 programs per SM on 132 SMs; the default (256 x
    16, 4 waves) gave 3.6 on gate_up (a tail wave at 2 resident 255-register programs per SM)."""
    if k >= 2 * n:
        return KnConfig(block_n=256, block_kw=16, waves=3)
    return KnConfig(block_n=128, block_kw=32)


def heuristic_path(m: int, n: int, k: int, group: int, bits: int, sms: int, has_kn: bool) -> WqPath:
    """The untimed pick (the module docstring's table)."""
    if m == 1 and has_kn:
        return WqPath("kn", kn_m1_config(n, k))
    # M = 2..16: the 16-row dot tile (wq_matmul's own heuristic gives M <= 4 to its GEMV, 2.4x slower at M = 4)
    return WqPath("old", heuristic_config(16 if 2 <= m <= 16 else m, n, k, group, sms, bits))


def candidates_for(m: int, n: int, k: int, group: int, bits: int, sms: int, has_kn: bool) -> list[WqPath]:
    """What the tuner times for M rows (a power of two <= 16), the untimed pick first. Each is a compile
    (~1 s; 4 shapes x 5 M buckets x ~6 = ~2 minutes of start-up), so few: M = 1: the kn tiles that won a
    shape on the H200, narrower tiles with more split-K for narrow N (o: 0.91 TB/s with 16 splits of one
    step) and the old GEMV; M = 2..16: the 16-row dot tile as measured and with longer K steps (more bytes in
    flight) or wider N, and with the kn copy the multi-row GEMV at two tiles."""
    first = heuristic_path(m, n, k, group, bits, sms, has_kn)
    cands = [first]
    if m == 1:
        if has_kn:
            cands += [WqPath("kn", c) for c in (
                KnConfig(block_n=512, block_kw=8), KnConfig(block_n=128, block_kw=32),
                KnConfig(block_n=256, block_kw=16, waves=3), KnConfig(block_n=64, block_kw=32, waves=6))]
            cands.append(WqPath("old", heuristic_config(1, n, k, group, sms, bits)))
    else:
        tiles = triton.cdiv(n, 64)
        split64 = max(1, min(triton.cdiv(sms, tiles), 4))
        cands += [WqPath("old", WqConfig("dot_join", 16, 32, 256, 1, num_warps=4, num_stages=3)),
                  WqPath("old", WqConfig("dot_join", 16, 32, 128, max(1, min(triton.cdiv(sms, triton.cdiv(n, 32)), 8)),
                                         num_warps=4, num_stages=4)),  # the untimed pick until 2026-12-07
                  WqPath("old", WqConfig("dot_join", 16, 64, 128, split64, num_warps=4, num_stages=4))]
        if has_kn and bits == 4:
            # sm_90 ptxas, no spills: r4 n128 kw8 167 registers, r8 n64 kw8 167, r8 n128 kw8 230, r16 n64 249
            if m <= 4:
                rows_tiles = ((m, 128, 8), (m, 256, 8))
            elif m <= 8:
                rows_tiles = ((8, 64, 8), (4, 128, 8))
            else:
                rows_tiles = ((16, 64, 8), (8, 64, 8))
            cands += [WqPath("kn", KnConfig(block_n=bn, block_kw=bkw, rows=r)) for r, bn, bkw in rows_tiles]
    out: list[WqPath] = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out


def _bucket(m: int) -> int:
    return triton.next_power_of_2(m)


class WqDispatcher:
    """Per-shape path choice for wq_linear on CUDA. Not thread-safe (the model's thread uses it)."""

    def __init__(self, tune: bool | None = None) -> None:
        self.tune = os.environ.get(TUNE_SWITCH, "0") == "1" if tune is None else tune
        self.paths: dict[tuple, WqPath] = {}
        self.timings: dict[tuple, list[tuple[str, float]]] = {}
        self.rejected: dict[tuple, list[str]] = {}
        self._sms: dict[int, int] = {}

    def sms(self, x: torch.Tensor) -> int:
        dev = x.device.index if x.device.index is not None else (torch.cuda.current_device() if x.is_cuda else -1)
        if dev not in self._sms:
            self._sms[dev] = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        return self._sms[dev]

    def __call__(self, x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 bits: int, kn: KnWeight | None = None) -> torch.Tensor:
        """x2 [M, K] -> [M, N] in x2's dtype."""
        m, k = x2.shape
        n = qweight.shape[0]
        groups = scales.shape[1]
        group = k // groups if groups else 0
        has_kn = kn is not None and m <= MAX_DECODE
        sms = self.sms(x2)
        key = (_bucket(m), n, k, group, bits, x2.dtype, str(x2.device), has_kn)
        path = self.paths.get(key)
        if path is None:
            capturing = x2.is_cuda and torch.cuda.is_current_stream_capturing()
            if self.tune and x2.is_cuda and m <= MAX_DECODE and not capturing:
                path = self._choose(key, x2, qweight, scales, offsets, bits, kn, sms)
            else:
                path = heuristic_path(m, n, k, group, bits, sms, has_kn)
                if not capturing:
                    self.paths[key] = path
        return run_path(path, x2, qweight, scales, offsets, bits, kn, sms)

    def _choose(self, key: tuple, x2, qweight, scales, offsets, bits, kn, sms) -> WqPath:
        """Times the candidates at M = the bucket on random rows; the fastest that matches the dequantized
        weight's matmul wins (the untimed pick where none passes)."""
        from lamina.kernels.gemv import _l2_bytes, rank_configs
        from lamina.kernels.wq_matmul import dequantize

        m, n, k, group, _, _, _, has_kn = key
        xb = torch.randn(m, k, dtype=x2.dtype, device=x2.device)
        ref = (xb.float() @ dequantize(qweight, scales, offsets, bits, torch.float32).t())
        flush = torch.ones(2 * _l2_bytes(x2.device) // 4, dtype=torch.float32, device=x2.device)
        cands = candidates_for(m, n, k, group, bits, sms, has_kn)
        results, rejected = rank_configs(
            cands, lambda p, out=None: run_path(p, xb, qweight, scales, offsets, bits, kn, sms), ref, flush,
            label=WqPath.label)
        if rejected:
            self.rejected.setdefault(key, []).extend(rejected)
        path = results[0][1] if results else cands[0]
        self.timings[key] = [(p.label(), t) for t, p in results]
        self.paths[key] = path
        return path


@functools.cache
def process_dispatcher() -> WqDispatcher:
    """One per process, like the bf16 GEMV's: a cache of per-shape picks shared by every model in it."""
    return WqDispatcher()
