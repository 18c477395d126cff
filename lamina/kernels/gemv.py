"""Decode linear: the Triton GEMV (triton_gemv.py) for M <= 16 rows on CUDA when switched on, else F.linear.

Opt-in: GemvDispatcher(enabled=None) reads LAMINA_TRITON_GEMV=1 once, at construction. The dispatcher owns
the per-shape config choice (timed once per (M bucket, N, K, dtype, bias, device) on the first CUDA call)
and the split-K workspaces; one dispatcher per model is enough (workspaces are reused across layers of the
same shape, which run one after another on one stream). F.linear is the reference and the fallback.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.nn.functional as F

from lamina.kernels.dispatch import use_triton

MAX_M = 16
ENV_SWITCH = "LAMINA_TRITON_GEMV"
# A prologue shape times the plain shape's fastest 4 configs, not all ~16: each (tile, prologue kind, M
# bucket) is a Triton compile of ~1-2 s, and 3 kinds x 4 buckets x 16 tiles would add minutes to start-up.
PROLOGUE_CANDIDATES = 4


class GemvDispatcher:
    """Chooses and runs the decode GEMV. Not thread-safe; use it from the thread that runs the model."""

    def __init__(self, enabled: bool | None = None, tune: bool = True) -> None:
        self.enabled = os.environ.get(ENV_SWITCH) == "1" if enabled is None else enabled
        self.tune = tune
        self.configs: dict[tuple, object] = {}  # shape key -> GemvConfig (timed winner)
        self.timings: dict[tuple, list[tuple[str, float]]] = {}  # shape key -> [(config label, us)] (reports)
        self.rejected: dict[tuple, list[str]] = {}  # shape key -> configs that failed the check or to compile
        self._ranked: dict[tuple, list] = {}  # shape key -> its passing configs, fastest first
        self._workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._sms: dict[int, int] = {}

    def accepts(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: bool = False) -> bool:
        """Whether the GEMV handles this call (else the caller uses F.linear). act: x is gate|up, [.., 2K],
        for an activation prologue."""
        if not (self.enabled and use_triton(x)) or weight.dim() != 2 or x.shape[-1] != weight.shape[1] * (1 + act):
            return False
        m = x.numel() // max(x.shape[-1], 1)
        return (1 <= m <= MAX_M and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
                and weight.stride(-1) == 1 and weight.shape[1] % 8 == 0
                and (bias is None or (bias.dim() == 1 and bias.is_contiguous())))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 prologue=None, epilogue=None) -> torch.Tensor:
        """y = pro(x) W^T + b; prologue: a triton_gemv.Prologue (its residual and sum_out shaped like x) or None.
        Each prologue kind is timed as a shape of its own: its extra fp32 tile math raises the dot configs'
        registers (ptxas, sm_90, bf16, m16 n32 k256: 64 plain, 148 with add + norm, 154 with SiLU; k512 spills
        with either), so the plain winner need not be the prologue's. epilogue: a triton_gemv.Epilogue (its
        residual and norm_out shaped like the output; an activation epilogue's output is half the weight's
        rows), timed the same way; for add_norm the returned tensor is the new residual stream."""
        from lamina.kernels import triton_gemv as tg

        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        n, k = weight.shape
        dev = x.device.index if x.device.index is not None else (torch.cuda.current_device() if x.is_cuda else -1)
        sms = self._sms.get(dev) or self._sms.setdefault(dev, tg._num_sms(x.device))
        key = (tg._bucket(m), n, k, x.dtype, bias is not None, dev) + ((prologue.kind,) if prologue else ()) \
            + (("epi", epilogue.kind) if epilogue else ())
        cfg = self.configs.get(key)
        if cfg is None:
            if not self.tune or torch.cuda.is_current_stream_capturing():  # nothing to time or allocate here
                cfg = tg.heuristic_config(m, _out_rows(n, epilogue), k, sms, allow_split=False)
            else:
                cfg = self._choose(key, x2, weight, bias, sms, prologue, epilogue)
        if prologue is not None and prologue.residual is not None:
            prologue = dataclasses.replace(prologue, residual=prologue.residual.reshape(m, -1),
                                           sum_out=prologue.sum_out.view(m, -1))
        if epilogue is not None and epilogue.residual is not None:
            epilogue = dataclasses.replace(epilogue, residual=epilogue.residual.reshape(m, -1),
                                           norm_out=epilogue.norm_out.view(m, -1))
        y = tg.gemv(x2, weight, bias, cfg, self._workspace(key, cfg, x.device, epilogue), prologue=prologue,
                    epilogue=epilogue)
        return y.view(*x.shape[:-1], y.shape[-1])

    def _workspace(self, key: tuple, cfg, device: torch.device, epilogue=None):
        from lamina.kernels import triton_gemv as tg

        kind = epilogue.kind if epilogue is not None else None
        if not tg.needs_workspace(cfg, kind):
            return None
        wkey = (key, cfg)
        ws = self._workspaces.get(wkey)
        if ws is None:  # kept for the dispatcher's lifetime: captured graphs hold these pointers
            ws = self._workspaces[wkey] = tg.new_workspace(key[0], _out_rows(key[1], epilogue), cfg, device, kind)
        return ws

    def _choose(self, key: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                sms: int, prologue=None, epilogue=None):
        """Times every candidate on this shape (M rounded up to the bucket) and keeps the fastest that
        matches F.linear. Timing: a CUDA-graph replay of a few calls, each after an L2 flush, minus the
        flushes alone. The flush reads (sums) a buffer of twice the L2 size: a write flush would leave dirty
        lines whose write-back would slow the timed GEMV."""
        from lamina.kernels import triton_gemv as tg

        m = key[0]
        xb, pro, ref_in = _sample_input(m, key[2], x, prologue)
        ref = F.linear(ref_in, weight, bias).float()
        epi, ref, pick = _sample_epilogue(epilogue, ref, x.dtype)
        flush = torch.ones(2 * _l2_bytes(x.device) // 4, dtype=torch.float32, device=x.device)
        cands = tg.candidate_configs(m, _out_rows(key[1], epilogue), key[2], sms)
        if prologue is not None or epilogue is not None:  # the plain shape's fastest few: each is a compile
            plain = key[:6]
            if plain not in self._ranked:
                self._choose(plain, x, weight, bias, sms)
            cands = self._ranked.get(plain, cands)
            if epilogue is not None and epilogue.kind != "add_norm":
                cands = _act_epilogue_candidates(cands)
            cands = cands[:PROLOGUE_CANDIDATES]

        def run(cfg, out=None):
            ws = self._workspace(key, cfg, x.device, epilogue)
            return tg.gemv(xb, weight, bias, cfg, ws, out=out, prologue=pro, epilogue=epi)

        results, rejected = rank_configs(cands, run, ref, flush, label=lambda c: c.label(), pick=pick)
        if rejected:
            self.rejected.setdefault(key, []).extend(rejected)
        if not results:
            return tg.heuristic_config(m, _out_rows(key[1], epilogue), key[2], sms, allow_split=False)
        self._ranked[key] = [c for _, c in results]
        self.timings[key] = [(c.label(), t) for t, c in results]
        self.configs[key] = results[0][1]
        return results[0][1]


def rank_configs(cands, run, ref: torch.Tensor, flush: torch.Tensor, label=str, pick=lambda y: y,
                 tol: float = 2e-2) -> tuple[list[tuple[float, object]], list[str]]:
    """The tuner the decode dispatchers share (this one and wq_dispatch.WqDispatcher): each candidate runs
    once, is checked against `ref` (relative error of pick(output) < tol), then timed by _graph_time_us with
    its first output as `out`. run(cfg, out=None) -> output. Returns ([(us, cfg)] fastest first, [why each
    rejected one was]); a candidate that fails to compile or fit is rejected, not raised."""
    results: list[tuple[float, object]] = []
    rejected: list[str] = []
    for cfg in cands:
        try:
            y = run(cfg)
            got = pick(y).float()
            err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if err < tol:
                results.append((_graph_time_us(lambda cfg=cfg, y=y: run(cfg, out=y), flush), cfg))
            else:
                rejected.append(f"{label(cfg)}: error {err:.1e}")
        except Exception as exc:  # noqa: BLE001 - a config that fails to compile or fit is no candidate
            rejected.append(f"{label(cfg)}: {type(exc).__name__}")
    results.sort(key=lambda r: r[0])
    return results, rejected


def _sample_input(m: int, k: int, x: torch.Tensor, prologue):
    """(x, prologue, reference input of F.linear) to time and check a config with: random rows, and for a
    prologue the call's own norm weight, a random residual and a fresh sum buffer."""
    from lamina.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
    from lamina.kernels.norm import rms_norm_ref

    kind = prologue.kind if prologue is not None else None
    xb = torch.randn(m, 2 * k if kind in ("silu", "gelu_tanh") else k, dtype=x.dtype, device=x.device)
    if kind is None:
        return xb, None, xb
    if kind in ("silu", "gelu_tanh"):
        return xb, prologue, (silu_and_mul_ref if kind == "silu" else gelu_tanh_and_mul_ref)(xb)
    pro = dataclasses.replace(prologue, residual=None, sum_out=None)
    if kind == "add_norm":
        res = torch.randn_like(xb)
        pro = dataclasses.replace(pro, residual=res, sum_out=torch.empty_like(xb))
        return xb, pro, rms_norm_ref(xb + res, pro.weight, pro.eps, pro.offset)
    return xb, pro, rms_norm_ref(xb, pro.weight, pro.eps, pro.offset)


def _out_rows(n: int, epilogue) -> int:
    """Output columns of a weight with n rows: half of them under an activation epilogue (gate|up)."""
    return n // 2 if epilogue is not None and epilogue.kind != "add_norm" else n


def _act_epilogue_candidates(ranked: list) -> list:
    """An activation epilogue's tiles from the plain gate|up shape's ranking: unsplit only, each at its own
    block_n and at half of it (a program then streams as many weight bytes as the plain tile did)."""
    out = []
    for cfg in ranked:
        if cfg.split_k != 1:
            continue
        for bn in (cfg.block_n // 2, cfg.block_n):
            if bn >= (16 if cfg.dot else 1):
                c = dataclasses.replace(cfg, block_n=bn)
                if c not in out:
                    out.append(c)
    return out


def _sample_epilogue(epilogue, ref_y: torch.Tensor, dtype: torch.dtype):
    """(epilogue to time with, its reference output, which of the GEMV's outputs to compare): the linear's
    reference through the unfused op; add_norm compares the norm output, on a random residual."""
    from lamina.kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
    from lamina.kernels.norm import rms_norm_ref

    if epilogue is None:
        return None, ref_y, lambda y: y
    if epilogue.kind != "add_norm":
        act = silu_and_mul_ref if epilogue.kind == "silu" else gelu_tanh_and_mul_ref
        return epilogue, act(ref_y), lambda y: y
    res = torch.randn(ref_y.shape, dtype=dtype, device=ref_y.device)
    h = torch.empty_like(res)
    epi = dataclasses.replace(epilogue, residual=res, norm_out=h)
    return epi, rms_norm_ref(ref_y + res.float(), epilogue.weight, epilogue.eps, epilogue.offset).float(), \
        lambda y: h


def _l2_bytes(device: torch.device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20))


def _graph_time_us(fn, flush: torch.Tensor, reps: int = 8, replays: int = 5) -> float:
    def captured(with_fn: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                flush.sum()
                if with_fn:
                    fn()
        return graph

    fn()
    torch.cuda.synchronize()
    times = []
    for with_fn in (True, False):
        graph = captured(with_fn)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        times.append(sorted(samples)[len(samples) // 2])
    return max(times[0] - times[1], 0.0) * 1e3 / reps


def linear_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  dispatcher: GemvDispatcher | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the Triton GEMV where `dispatcher` is switched on and accepts the
    call (CUDA, M <= 16 rows, bf16/fp16 with matching dtypes)."""
    if dispatcher is not None and dispatcher.accepts(x, weight, bias):
        return dispatcher(x, weight, bias)
    return F.linear(x, weight, bias)


@functools.cache
def _process_dispatcher() -> GemvDispatcher:
    return GemvDispatcher(enabled=True)


def env_dispatcher() -> GemvDispatcher | None:
    """The dispatcher Linear layers built while LAMINA_TRITON_GEMV=1 share (None when it is not set). One per
    process on purpose: it is a cache of per-shape timings and split-K workspaces, like Triton's own kernel
    cache, so every model in the process (a draft model too) tunes each shape once. Its calls all run on the
    thread and stream that run the models, one after another."""
    return _process_dispatcher() if os.environ.get(ENV_SWITCH) == "1" else None
