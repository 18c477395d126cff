"""FP8 checkpoints written from the tiny fp32 ones, to the published formats, each with its dequantized fp32
copy for HF transformers (the oracle):
- quant_method "fp8" with weight_block_size (Qwen/DeepSeek): `weight` float8_e4m3fn and `weight_scale_inv`
  [ceil(out/bn), ceil(in/bk)] with w = weight * weight_scale_inv per block;
- compressed-tensors "float-quantized": quantized and dequantized by the compressed-tensors package itself.
Per-expert tensors are written as experts.N.{gate,up,down}_proj.* (the layout the FP8 MoE releases use);
the dequantized copy keeps the source's own tensor names and layout.
"""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lamina.kernels.fp8 import dequantize, quantize_blocks

_LINEAR = re.compile(r"^(model\.layers\.\d+\.(self_attn|mlp)(\.experts\.\d+)?\.(q|k|v|o|gate|up|down)_proj)\.weight$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")

# weight [out, in] -> ({suffix: tensor} to store, the dequantized weight)
Quantizer = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def block_quantizer(block: tuple[int, int]) -> Quantizer:
    def quantize(w: torch.Tensor):
        q, s = quantize_blocks(w, block)
        return {"weight": q, "weight_scale_inv": s}, dequantize(q, s, block)

    return quantize


def ct_quantizer(scheme) -> Quantizer:
    """compressed-tensors' own FloatQuantizationCompressor (compress, then decompress for the oracle copy)."""
    from compressed_tensors.compressors import FloatQuantizationCompressor

    args = scheme.weights

    def quantize(w: torch.Tensor):
        if args.strategy == "channel":
            amax = w.abs().amax(1, keepdim=True)
        elif args.strategy == "tensor":
            amax = w.abs().amax().reshape(1)
        else:
            bn, bk = args.block_structure
            n, k = w.shape
            amax = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn)).view(
                -(-n // bn), bn, -(-k // bk), bk).abs().amax((1, 3))
        stored = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": amax / 448}, scheme)
        deq = FloatQuantizationCompressor.decompress(dict(stored), scheme)["weight"].float()
        if scheme.input_activations is not None and not scheme.input_activations.dynamic:
            stored["input_scale"] = torch.tensor([0.02])
        return stored, deq

    return quantize


def write_quantized(src: Path, dst: Path, quantize: Quantizer, quant_config: dict,
                    skip: Callable[[str], bool] = lambda name: False) -> tuple[Path, Path]:
    """(quantized checkpoint dir, dequantized fp32 copy dir) made from the fp32 checkpoint `src`."""
    qdir, ddir = dst / "fp8", dst / "dequantized"
    for d in (qdir, ddir):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, d / f.name)
    cfg = json.loads((src / "config.json").read_text())
    (qdir / "config.json").write_text(json.dumps(dict(cfg, quantization_config=quant_config)))
    qt, dt = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if (m := _LINEAR.match(name)) and not skip(m.group(1)):
            stored, deq = quantize(t)
            qt.update({f"{m.group(1)}.{k}": v.contiguous() for k, v in stored.items()})
            dt[name] = deq.contiguous()
        elif (m := _STACKED.match(name)) and not skip(m.group(1)):
            prefix, proj = m.groups()
            restacked = []
            for e in range(t.shape[0]):
                halves = {"gate_proj": t[e, :t.shape[1] // 2], "up_proj": t[e, t.shape[1] // 2:]} \
                    if proj == "gate_up_proj" else {"down_proj": t[e]}
                deqs = []
                for hf, w in halves.items():
                    stored, deq = quantize(w.contiguous())
                    qt.update({f"{prefix}.{e}.{hf}.{k}": v.contiguous() for k, v in stored.items()})
                    deqs.append(deq)
                restacked.append(torch.cat(deqs))
            dt[name] = torch.stack(restacked).contiguous()
        else:
            qt[name] = dt[name] = t
    save_file(qt, str(qdir / "model.safetensors"))
    save_file(dt, str(ddir / "model.safetensors"))
    return qdir, ddir
