"""The model's own sampling defaults: an HF directory's generation_config.json, or a GGUF file's
`general.sampling.*` metadata, as with vLLM's `--generation-config`.

A setting the caller gives wins; then the model's default (unless the source is "vllm"); then the caller's
fallback (each command has its own: `generate` is greedy, `chat` samples, the server follows OpenAI).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("lamina")

# The settings a model may default, by SamplingParams name.
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
SOURCES_HELP = ("auto: the model's generation_config.json or GGUF sampling metadata; vllm: ignore the model's "
                "and use lamina's own defaults; or a directory holding a generation_config.json")


def _valid(name: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if name in ("top_k", "max_tokens"):
        return float(value).is_integer() and (value >= 1 if name == "max_tokens" else value >= -1)
    if name == "temperature":
        return value >= 0
    if name in ("top_p",):
        return 0 < value <= 1
    if name == "min_p":
        return 0 <= value <= 1
    return value > 0  # repetition_penalty


def _pick(raw: dict[str, Any], keys: dict[str, str], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in keys.items():
        if key not in raw or raw[key] is None:
            continue
        value = raw[key]
        if not _valid(name, value):
            log.warning("ignoring %s=%r in %s (out of range)", key, value, where)
            continue
        out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    return out


def from_hf_dir(path: Path) -> dict[str, Any]:
    """Defaults from path/generation_config.json ({} if there is none)."""
    f = path / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        raw = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("ignoring %s: %s", f, e)
        return {}
    return _pick(raw, _HF_KEYS, str(f)) if isinstance(raw, dict) else {}


def from_gguf(path: Path) -> dict[str, Any]:
    from lamina.models.gguf_header import GGUFError, read_gguf_header

    try:
        meta = read_gguf_header(path).metadata
    except GGUFError:
        return {}  # the loader reports a broken file
    return _pick(meta, _GGUF_KEYS, str(path))


def model_defaults(model: str, source: str = "auto") -> dict[str, Any]:
    """The sampling defaults to use for `model` (a subset of FIELDS) given --generation-config `source`."""
    if source == "vllm":
        return {}
    if source != "auto":
        d = Path(source).expanduser()
        if not (d / "generation_config.json").is_file():
            raise ValueError(f"--generation-config {source}: no generation_config.json there "
                             "(give auto, vllm or a directory holding one)")
        return from_hf_dir(d)
    from lamina.preflight import UsageError, model_file

    try:
        kind, path = model_file(model)
    except UsageError:
        return {}
    if kind == "hf":
        return from_hf_dir(path)
    if kind in ("gguf", "builtin"):
        return from_gguf(path)
    return {}


def resolve(explicit: dict[str, Any], defaults: dict[str, Any], fallback: dict[str, Any]) -> dict[str, Any]:
    """Each field: the explicit value if not None, else the model's default, else the fallback."""
    out = dict(fallback)
    out.update(defaults)
    out.update({k: v for k, v in explicit.items() if v is not None})
    return out
