#!/usr/bin/env python3
"""The torch ops one decode step of one decoder layer runs, as a list (CPU or GPU; counts, no timings).

Runs the engine eagerly on a random preset cut to a few layers, prefills one batch, then records every aten
op (TorchDispatchMode) that the chosen layer's forward runs during one decode step, with its module path
and output shape. On a CPU the fused CUDA paths are not taken (each op's reference runs instead); on a GPU a
Triton launch shows up only through the torch ops around it (allocations), so read the counts with the
dispatch notes of BENCHMARKS / GPU_KERNELS.md. Meant for A/B counts: main vs branch on the same preset.

    python scripts/decode_ops.py --model random:deepseek-v2-lite --layers 2 --layer 1 --small
    python scripts/decode_ops.py --model random:deepseek-v2-lite --layers 2 --layer 1 --small --fused-moe

--fused-moe takes the CUDA-only fused MoE decode path on the CPU (Triton's interpreter, as the kernel tests
do) and lists its Triton launches as "triton:<kernel>" ops, so the MoE block's list is the one a GPU runs.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lamina import LLM, SamplingParams
from lamina.models import presets

# Shrunk widths that keep a preset's structure (experts, top-k, heads, MLA ranks, layer kinds): the op list
# does not depend on the widths, and a CPU builds the model in seconds instead of minutes.
SMALL = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "vocab_size": 4096,
         "shared_expert_intermediate_size": 64}
_SKIP = {"aten.detach.default", "aten._to_copy.default.noop"}


class OpLog(TorchDispatchMode):
    """Every aten op while `on`, as (module path, op name, output shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False
        self.where: list[str] = []
        self.ops: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if self.on and name not in _SKIP:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            self.ops.append((self.where[-1] if self.where else "", name, str(shape)))
        return out


def attach(layer: torch.nn.Module, log: OpLog) -> list:
    hooks = []
    for name, mod in layer.named_modules():
        def pre(m, a, name=name):
            log.where.append(name or type(m).__name__)

        def post(m, a, o):
            log.where.pop()
        hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return hooks


@contextlib.contextmanager
def fused_moe_on_cpu(log: OpLog):
    """The fused MoE decode dispatch through Triton's interpreter, each kernel launch logged as an op."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.runtime.interpreter as interp

    import lamina.kernels.moe_decode as md
    from lamina.models.layers import moe_decode_path

    run = interp.InterpretedFunction.run

    def logged(self, *args, **kwargs):
        on = log.on
        if on:
            log.ops.append((log.where[-1] if log.where else "", f"triton:{self.fn.__name__}", str(kwargs["grid"])))
        log.on = False  # the interpreter's own copies of the arguments are no ops of the step
        try:
            return run(self, *args, **kwargs)
        finally:
            log.on = on
    saved = moe_decode_path.use_triton, md.use_triton
    interp.InterpretedFunction.run = logged
    moe_decode_path.use_triton = md.use_triton = lambda t: True
    try:
        yield
    finally:
        interp.InterpretedFunction.run = run
        moe_decode_path.use_triton, md.use_triton = saved


def record(model_name: str, layer_index: int, batch: int, input_len: int,
           fused_moe: bool = False) -> list[tuple[str, str, str]]:
    llm = LLM(model=model_name, max_num_seqs=max(batch, 2), enforce_eager=True, progress=False,
              kv_cache_memory_gb=0.25)
    prompts = [{"prompt_token_ids": [10 + (i * 31 + j) % 1000 for j in range(input_len)]} for i in range(batch)]
    model = llm.engine.model
    layers = [m for n, m in model.named_modules() if n.endswith(f"layers.{layer_index}")]
    if not layers:
        raise SystemExit(f"no layers.{layer_index} in {model_name}")
    log = OpLog()
    hooks = attach(layers[0], log)
    steps = [0]

    def count_step(m, a):  # the layer's second call is the first decode step (the first: the prefill)
        steps[0] += 1
        log.on = steps[0] == 2

    def stop(m, a, o):
        log.on = False
    hooks += [layers[0].register_forward_pre_hook(count_step, prepend=True), layers[0].register_forward_hook(stop)]
    try:
        with log, (fused_moe_on_cpu(log) if fused_moe else contextlib.nullcontext()):
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    return log.ops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:deepseek-v2-lite")
    ap.add_argument("--layers", type=int, default=2, help="cut the preset to this many layers")
    ap.add_argument("--layer", type=int, default=1, help="the layer whose decode ops are listed")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--small", action="store_true", help="shrink the widths, keep the structure (SMALL)")
    ap.add_argument("--summary", action="store_true", help="counts per op and module only")
    ap.add_argument("--fused-moe", action="store_true", help="the fused MoE decode path via Triton's interpreter")
    args = ap.parse_args()
    name = args.model.split(":", 1)[1]
    cfg = dict(presets.PRESETS[name], num_hidden_layers=args.layers)
    if args.small:
        cfg.update({k: v for k, v in SMALL.items() if k in cfg})
        if "head_dim" in cfg and "num_attention_heads" in cfg:
            cfg["head_dim"] = min(cfg["head_dim"], 64)
    presets.PRESETS[f"{name}-ops"] = cfg
    ops = record(f"random:{name}-ops", args.layer, args.batch, args.input_len, args.fused_moe)
    print(f"{args.model} (layers {args.layers}{', small widths' if args.small else ''}), layer {args.layer}, "
          f"batch {args.batch}{', fused MoE via the interpreter' if args.fused_moe else ''}: {len(ops)} ops in one "
          f"decode step ({sum(op.startswith('triton:') for _, op, _ in ops)} Triton launches)")
    if not args.summary:
        for where, op, shape in ops:
            print(f"  {where[:44]:44s} {op[:40]:40s} {shape}")
    by_mod = collections.Counter(w.split(".")[0] for w, _, _ in ops)
    print("per module: " + ", ".join(f"{k} {v}" for k, v in by_mod.most_common()))
    by_op = collections.Counter(op for _, op, _ in ops)
    print("per op: " + ", ".join(f"{k.removeprefix('aten.')} {v}" for k, v in by_op.most_common()))


if __name__ == "__main__":
    main()
