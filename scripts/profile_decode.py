#!/usr/bin/env python3
"""Where a decode step's time goes, as a list: each op's device time, its bytes and its achieved bandwidth.

1. Runs the engine (CUDA graphs) for the step time, then one eager decode step with forward hooks on every
   module, keeping each module's inputs and outputs.
2. Replays each kind of module (one representative per name pattern, e.g. model.layers.*.self_attn.qkv_proj)
   alone on those inputs: on CUDA a graph of a few calls, each after an L2 flush (a read of twice the L2 size,
   so weights come from HBM as in a real step), minus the flushes alone; on a CPU a wall-clock median. A
   module's own time is its time minus its children's (an attention mixer's own time is q/k norm + RoPE + KV
   store + attention; its projections are its children).
3. Bytes are the fewest each op must move, from shapes: a leaf's own parameters (of stacked experts only the
   share a batch touches) plus the tensors it reads and writes; a parent's tensors its own ops pass between its
   children (what a child returns and no other child or the caller takes, what a child takes that no child
   made) plus the layer's state traffic (KV of the context read, this step's KV written; recurrent states read
   and written). Achieved GB/s = bytes / own time; the floor is bytes at the measured copy bandwidth; the
   list is sorted by the time lost against that floor (count x (own time - floor)).
4. Optionally (--kernels) the torch.profiler list of kernels by name, as before.

    python scripts/profile_decode.py --model random:qwen3-8b --batch 1
    python scripts/profile_decode.py --model random:qwen3-next-80b-a3b-24l --layers 4 --batch 64 --kernels
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from lamina import LLM, SamplingParams
from lamina.models import presets


def _tensors(obj, out: list[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors(o, out)
    return out


def _storages(obj) -> dict[int, int]:
    """storage pointer -> bytes of the tensors (views) of it that obj holds; shared storages count once, at
    the largest view."""
    seen: dict[int, int] = {}
    for t in _tensors(obj, []):
        if t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())
    return seen


class Recorder:
    """Forward hooks that keep the last call of every module: (args, kwargs, output) and the call order."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[str, tuple] = {}
        self.modules = dict(model.named_modules())
        self._handles = [m.register_forward_hook(self._hook(name), with_kwargs=True)
                         for name, m in self.modules.items()]
        # Each model call starts afresh, so only the last step's modules are kept: a module that only a
        # prefill calls (MLA's kv_b_proj, which decode replaces by the absorbed weights) is no decode op.
        self._handles.append(model.register_forward_pre_hook(lambda m, a: self.calls.clear()))

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            self.calls[name] = (args, kwargs, output)
        return hook

    def called_children(self, name: str) -> list[str]:
        """The nearest called descendants: a module the parent's own code calls directly, even through an
        uncalled container (CausalLM calls the layers of its Backbone itself)."""
        prefix = f"{name}." if name else ""
        below = [n for n in self.calls if n.startswith(prefix) and n != name]
        return [n for n in below if not any(n.startswith(f"{o}.") for o in below if o != n)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def group_key(rec: Recorder, name: str) -> tuple[str, str]:
    """Modules timed once for all: same name pattern, same class, same classes of called children (a hybrid's
    decoder layers differ by mixer)."""
    kids = ",".join(sorted({type(rec.modules[k]).__name__ for k in rec.called_children(name)}))
    cls = type(rec.modules[name]).__name__
    return pattern(name), f"{cls}({kids})" if kids and name.count(".") <= 2 and cls == "DecoderLayer" else cls


def expert_fraction(model: nn.Module, tokens: int) -> dict[int, float]:
    """id(param) -> expected share of a stacked expert tensor that `tokens` routed tokens touch."""
    from lamina.models.layers.moe import SparseMoE

    frac: dict[int, float] = {}
    for m in model.modules():
        if isinstance(m, SparseMoE):
            always = m.experts_per_token - m.top_k  # folded shared experts: read at every step
            routed = m.experts.num_experts - always
            share = (routed * (1.0 - (1.0 - m.top_k / routed) ** tokens) + always) / m.experts.num_experts
            for p in m.experts.parameters():
                frac[id(p)] = share
    return frac


def own_param_bytes(rec: Recorder, name: str, frac: dict[int, float]) -> float:
    """Parameters and buffers this module's own code reads: its own and those of descendants never called
    as modules (SparseMoE reads its FusedExperts' stacked weights itself)."""
    module = rec.modules[name]
    if isinstance(module, nn.Embedding):
        return 0.0  # one row per token is read, counted with the output
    called = rec.called_children(name)
    total = 0.0
    for sub_name, sub in module.named_modules(prefix=name):
        if any(sub_name == c or sub_name.startswith(f"{c}.") for c in called):
            continue
        for t in list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False)):
            total += t.numel() * t.element_size() * frac.get(id(t), 1.0)
    # weights derived at load and held as plain tensors: MLA's absorbed W_UK / W_UV^T (the decode form reads
    # them instead of kv_b_proj, which is then counted above as a never-called child: count one of the two)
    derived = getattr(module, "_absorbed", None)
    if derived is not None and hasattr(module, "kv_b_proj") and f"{name}.kv_b_proj" not in called:
        total -= sum(t.numel() * t.element_size() for t in module.kv_b_proj.parameters())
    if derived is not None:
        total += sum(t.numel() * t.element_size() for t in derived)
    return total


def state_bytes(module: nn.Module, args) -> float:
    """KV or recurrent-state traffic of one mixer call (0 for modules without state)."""
    meta = next((a for a in args if hasattr(a, "seq_lens_cpu")), None)
    if meta is None or not hasattr(module, "state_spec"):
        return 0.0
    dtype = next(module.parameters()).dtype
    spec = module.state_spec(dtype)
    if spec is None:
        return 0.0
    if hasattr(spec, "bytes_per_block"):
        per_token = spec.bytes_per_block(1)
        window = getattr(spec, "window", None)
        ctx = sum(min(s, window) if window else s for s in meta.seq_lens_cpu)
        new = meta.query_start_cpu[-1] if meta.query_start_cpu else 0
        return per_token * (ctx + new)
    return 2.0 * spec.bytes_per_slot * meta.num_seqs


def op_bytes(rec: Recorder, name: str, frac: dict[int, float]) -> float:
    module = rec.modules[name]
    args, kwargs, output = rec.calls[name]
    children = rec.called_children(name)
    nbytes = own_param_bytes(rec, name, frac) + state_bytes(module, args)
    ins, outs = _storages((args, kwargs)), _storages(output)
    if not children:
        return nbytes + sum(ins.values()) + sum(outs.values())
    c_in, c_out = {}, {}
    for c in children:
        c_in.update(_storages(rec.calls[c][:2]))
        c_out.update(_storages(rec.calls[c][2]))
    glue = sum(b for k, b in c_out.items() if k not in c_in and k not in outs)  # read by this module's own ops
    glue += sum(b for k, b in c_in.items() if k not in c_out and k not in ins)  # written by them
    return nbytes + glue


def time_call_us(module: nn.Module, args, kwargs, flush: torch.Tensor | None, reps: int = 4) -> float:
    """Device microseconds per call (CUDA: graph replays after L2 flushes, minus the flushes)."""
    def call():
        return module(*args, **kwargs)

    if flush is None:  # CPU: wall clock
        call()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6
    call()
    torch.cuda.synchronize()
    times = []
    for with_call in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                flush.sum()
                if with_call:
                    call()
        graph.replay()
        samples = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        times.append(statistics.median(samples))
    return max(times[0] - times[1], 0.0) / reps


def op_table(llm: LLM, prompts, batch: int, copy_bw: float) -> list[dict]:
    model = llm.engine.model
    rec = Recorder(model)
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        rec.remove()
    cuda = next(model.parameters()).is_cuda
    flush = None
    if cuda:
        l2 = torch.cuda.get_device_properties(next(model.parameters()).device).L2_cache_size
        flush = torch.ones(2 * l2 // 4, dtype=torch.float32, device=next(model.parameters()).device)
    frac = expert_fraction(model, batch)
    groups: dict[tuple[str, str], list[str]] = {}
    for name in rec.calls:
        groups.setdefault(group_key(rec, name), []).append(name)
    rep = {key: names[1] if len(names) > 1 else names[0] for key, names in groups.items()}
    inclusive: dict[str, float] = {}
    with torch.inference_mode():
        for name in rep.values():
            args, kwargs, _ = rec.calls[name]
            try:
                inclusive[name] = time_call_us(rec.modules[name], args, kwargs, flush)
            except Exception as exc:  # noqa: BLE001 - e.g. a module that cannot be captured alone: say so
                print(f"  could not time {name}: {type(exc).__name__}: {str(exc)[:120]}")
                inclusive[name] = float("nan")
    rows = []
    for (pat, cls), names in groups.items():
        name = rep[(pat, cls)]
        kids = rec.called_children(name)
        kid_time = sum(inclusive.get(rep[group_key(rec, k)], float("nan")) for k in kids)
        own = inclusive[name] - kid_time if kids else inclusive[name]
        nbytes = op_bytes(rec, name, frac)
        floor = nbytes / copy_bw * 1e6
        rows.append({"op": pat or "(model, own ops)", "cls": cls, "count": len(names), "inclusive_us": inclusive[name],
                     "own_us": max(own, 0.0), "bytes": nbytes, "floor_us": floor,
                     "gbs": nbytes / own / 1e3 if own > 0 else float("nan"),
                     "lost_us": len(names) * max(own - floor, 0.0)})
    return rows


def print_table(rows: list[dict], copy_bw: float, step_us: float | None) -> None:
    rows = sorted(rows, key=lambda r: r["lost_us"], reverse=True)
    print("\nper-op device time of one decode step (own time = minus children), "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print(f"{'op':52s} {'class':16s} {'n':>3s} {'us/call':>8s} {'total us':>9s} {'MB/call':>8s} {'GB/s':>6s} "
          f"{'%copy':>6s} {'lost us':>8s}")
    total_own = total_floor = 0.0
    for r in rows:
        if r["own_us"] < 0.05 and r["bytes"] < 1e4:
            continue  # containers whose own work is nothing
        pct = 100 * r["gbs"] * 1e9 / copy_bw if r["gbs"] == r["gbs"] else float("nan")
        total_own += r["count"] * r["own_us"]
        total_floor += r["count"] * r["floor_us"]
        print(f"{r['op'][:52]:52s} {r['cls'][:16]:16s} {r['count']:3d} {r['own_us']:8.1f} "
              f"{r['count'] * r['own_us']:9.1f} "
              f"{r['bytes'] / 1e6:8.2f} {r['gbs']:6.0f} {pct:6.1f} {r['lost_us']:8.1f}")
    print(f"sum of own times {total_own:.0f} us; floor at copy bandwidth {total_floor:.0f} us "
          f"({100 * total_floor / max(total_own, 1e-9):.1f}%)"
          + (f"; engine step (graphs, incl. sampling and host) {step_us:.0f} us" if step_us else ""))


def kernel_profile(llm: LLM, prompts, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or e.self_device_time_total]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    print(f"\nkernels of 1 prefill + 8 eager decode steps: {sum(e.count for e in events)} launches, "
          f"{total / 1e3:.2f} ms device time")
    for e in events[:top]:
        print(f"{e.self_device_time_total / 1e3:9.3f} ms {e.count:6d}x  {e.key[:110]}")


SWITCHES = {"gemv": ("LAMINA_TRITON_GEMV", "0"),
            "fusions": ("LAMINA_FUSED_MOE_DECODE", "LAMINA_FUSED_GDN_OUT", "LAMINA_FUSED_DENSE_DECODE")}


def set_variant(gemv: bool, fusions: bool) -> None:
    """The Triton decode GEMV (read when the Linear layers are built) and the decode fusions (read per call)."""
    os.environ["LAMINA_TRITON_GEMV"] = "1" if gemv else "0"
    for name in SWITCHES["fusions"]:
        os.environ[name] = "1" if fusions else "0"


def run_once(args, model: str, prompts) -> dict:
    from lamina.bench.offline import copy_bandwidth

    cuda = torch.cuda.is_available()
    step_us = None
    if cuda:  # the engine's own step time, with its CUDA graphs
        llm = LLM(model=model, max_num_seqs=max(args.batch, 8), progress=False,
                  kv_cache_memory_gb=args.kv_cache_memory_gb)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        step_us = (time.perf_counter() - start) / args.steps * 1e6
        print(f"graph: {args.steps} steps, ~{step_us:.0f} us/step incl. prefill")
        del llm
        torch.cuda.empty_cache()
    llm = LLM(model=model, max_num_seqs=max(args.batch, 8), enforce_eager=True, progress=False,
              kv_cache_memory_gb=args.kv_cache_memory_gb)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    copy_bw = copy_bandwidth(llm.engine.device)
    rows = op_table(llm, prompts, args.batch, copy_bw)
    print_table(rows, copy_bw, step_us)
    if args.kernels and cuda:
        kernel_profile(llm, prompts, args.top)
    del llm
    if cuda:
        torch.cuda.empty_cache()
    return {"step_us": step_us, "copy_GBs": copy_bw / 1e9, "ops": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--layers", type=int, default=None, help="cut the preset to this many layers")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kernels", action="store_true", help="also the torch.profiler kernel list")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=4)
    ap.add_argument("--gemv", choices=("off", "on", "both"), default="off",
                    help="the Triton decode GEMV in every dense Linear (LAMINA_TRITON_GEMV)")
    ap.add_argument("--fusions", choices=("off", "on", "both"), default="on",
                    help="the MoE decode path, the gated-norm out_proj GEMV and the dense layers' norm/SiLU GEMV "
                         "prologues (LAMINA_FUSED_*; the prologues need --gemv on)")
    ap.add_argument("--json", default=None, help="write every variant's table here (default $OUT/profile_*.json)")
    args = ap.parse_args()

    model = args.model
    if args.layers and model.startswith("random:"):
        name = model.split(":", 1)[1]
        presets.PRESETS[f"{name}-cut"] = dict(presets.PRESETS[name], num_hidden_layers=args.layers)
        model = f"random:{name}-cut"
    prompts = [{"prompt_token_ids": [1000 + (i * 31 + j) % 5000 for j in range(args.input_len)]}
               for i in range(args.batch)]
    pick = {"off": (False,), "on": (True,), "both": (False, True)}
    results = []
    for gemv in pick[args.gemv]:
        for fusions in pick[args.fusions]:
            set_variant(gemv, fusions)
            print(f"\n==== {model}, batch {args.batch}: GEMV {'on' if gemv else 'off'}, "
                  f"decode fusions {'on' if fusions else 'off'} ====", flush=True)
            results.append({"model": model, "batch": args.batch, "gemv": gemv, "fusions": fusions,
                            **run_once(args, model, prompts)})
    if len(results) > 1:
        print("\nvariants: " + "; ".join(
            f"GEMV {'on' if r['gemv'] else 'off'} / fusions {'on' if r['fusions'] else 'off'}: "
            f"{r['step_us'] or float('nan'):.0f} us/step (graphs), "
            f"{sum(o['count'] * o['own_us'] for o in r['ops']):.0f} us of op time" for r in results))
    path = args.json or (Path(os.environ["OUT"], f"profile_{model.split(':')[-1]}_b{args.batch}.json")
                         if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
