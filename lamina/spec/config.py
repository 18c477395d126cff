"""The speculative-decoding settings, shaped like vLLM's `speculative_config` (a dict, or its JSON on the
command line): {"method": "ngram" | "self_spec" | "draft_model" | "mtp", "num_speculative_tokens": K, ...}.

Kept free of torch and model code, so the command line can check a config before anything loads. Every bad
config is refused here (or, for what needs the checkpoint, at engine start-up) with one line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

METHODS = ("ngram", "self_spec", "draft_model", "mtp")
# Methods only `lamina bench latency|throughput` takes (spec/replay.py): LLM(...) and `lamina serve` refuse them.
BENCH_METHODS = ("replay",)
# Options each method takes besides method / num_speculative_tokens (vLLM's names where vLLM has them).
_OPTIONS = {
    "ngram": {"prompt_lookup_min", "prompt_lookup_max"},
    "self_spec": {"skip_layers"},
    "draft_model": {"model"},
    "mtp": set(),
    "replay": {"acceptance_prob", "seed", "forced"},
}
# Options of every method (lamina's own: vLLM has no such gate): drafting pauses per sequence while its
# acceptance average stays below min_acceptance_rate (0: never), probed again after probe_interval steps; the
# batch's average turns it off for every sequence the same way; disable_by_batch_size (vLLM's name): no drafting
# in a step where more than that many sequences decode (None: no limit). `gate` picks what turns drafting off
# batch-wide: "goodput" (default; spec/goodput.py) drafts only at batch sizes where it was measured to deliver
# more tokens/s than plain decoding by gate_margin, "acceptance" only while the batch's acceptance stays above
# min_acceptance_rate (spec/adaptive.py BatchGate), "off" never (the per-sequence pause is off too).
_GATE = {"min_acceptance_rate", "probe_interval", "disable_by_batch_size", "gate", "gate_margin"}
GATES = ("goodput", "acceptance", "off")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched against the sequence's earlier tokens
    prompt_lookup_max: int = 4  # ngram: longest (tried first)
    skip_layers: tuple[int, ...] | None = None  # self_spec: layer indices the drafter skips (None: the default)
    model: str | None = None  # draft_model: the drafter's checkpoint (same tokenizer and vocabulary)
    min_acceptance_rate: float = 0.1  # spec/adaptive.py: pause a sequence's drafting below this (0: never)
    probe_interval: int = 64  # decode steps a paused sequence runs without drafts before drafting again
    disable_by_batch_size: int | None = None  # no drafting while more than this many sequences decode
    gate: str = "goodput"  # what turns drafting off batch-wide: "goodput" | "acceptance" | "off" (see _GATE)
    gate_margin: float = 0.05  # goodput: drafting turns on when it beats plain tokens/s by this fraction
    acceptance_prob: float = 0.8  # replay (bench only): each draft is the reference token with this probability
    seed: int = 0  # replay: seed of which drafts are right
    # replay: forced acceptance. The verify step's accepted count is the proposer's right/wrong decision, not
    # the target's agreement (the output then follows the drafts): the device work of a real verify step at
    # acceptance acceptance_prob, whatever the numerics (spec/replay.py).
    forced: bool = False
    # Set by the bench's parse only: a bench-only method may run (LLM and serve refuse it otherwise).
    bench: bool = field(default=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        for name in sorted(_OPTIONS[self.method] | _GATE):
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out


def _int(cfg: dict, name: str, default: int, low: int) -> int:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"speculative_config: {name} must be an integer >= {low}, got {value!r}")
    return value


def _refuse_bench_only(method: str) -> None:
    raise ValueError(f"speculative_config: method {method!r} is bench-only (it replays a recorded continuation: "
                     f"lamina bench latency|throughput --speculative-config); choose from {', '.join(METHODS)}")


def parse_speculative_config(raw: SpeculativeConfig | dict[str, Any] | str | None,
                             bench: bool = False) -> SpeculativeConfig | None:
    """A checked SpeculativeConfig from a dict, its JSON text, or an existing config; None stays None.
    bench=True (`lamina bench` only) also takes the bench-only methods; an existing config with one of them
    must come from such a parse. Raises ValueError with one line naming what is wrong."""
    if raw is None:
        return raw
    if isinstance(raw, SpeculativeConfig):
        if raw.method in BENCH_METHODS and not raw.bench:
            _refuse_bench_only(raw.method)
        return raw
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(raw).__name__}")
    method = raw.get("method")
    if method is None and raw.get("model") is not None:
        method = "draft_model"  # vLLM infers the method from a draft model's name
    if method in BENCH_METHODS and not bench:
        _refuse_bench_only(method)
    if method not in METHODS + BENCH_METHODS:
        raise ValueError(f"speculative_config: unknown method {method!r} (choose from {', '.join(METHODS)})")
    unknown = set(raw) - {"method", "num_speculative_tokens"} - _OPTIONS[method] - _GATE
    if unknown:
        raise ValueError(f"speculative_config: method {method!r} takes no option(s) {', '.join(sorted(unknown))}")
    if "num_speculative_tokens" not in raw:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    k = _int(raw, "num_speculative_tokens", 0, 1)
    rate = raw.get("min_acceptance_rate", 0.1)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
        raise ValueError(f"speculative_config: min_acceptance_rate must be a number in [0, 1], got {rate!r}")
    # min_acceptance_rate 0 has meant "never stop drafting" since before the goodput gate: without a gate
    # named, it keeps that meaning (gate "off")
    which = raw.get("gate", "off" if "min_acceptance_rate" in raw and rate == 0 else "goodput")
    if which not in GATES:
        raise ValueError(f"speculative_config: gate must be one of {', '.join(GATES)}, got {which!r}")
    margin = raw.get("gate_margin", 0.05)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin <= 10:
        raise ValueError(f"speculative_config: gate_margin must be a number in [0, 10], got {margin!r}")
    gate = {"min_acceptance_rate": float(rate), "probe_interval": _int(raw, "probe_interval", 64, 1),
            "disable_by_batch_size": (None if raw.get("disable_by_batch_size") is None
                                      else _int(raw, "disable_by_batch_size", 0, 1)),
            "gate": which, "gate_margin": float(margin)}
    if method == "ngram":
        lo = _int(raw, "prompt_lookup_min", 1, 1)
        hi = _int(raw, "prompt_lookup_max", max(lo, 4), 1)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min {lo} > prompt_lookup_max {hi}")
        return SpeculativeConfig(method, k, prompt_lookup_min=lo, prompt_lookup_max=hi, **gate)
    if method == "self_spec":
        skip = raw.get("skip_layers")
        if skip is not None:
            if not isinstance(skip, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                     for i in skip):
                raise ValueError(f"speculative_config: skip_layers must be a list of layer indices, got {skip!r}")
            skip = tuple(sorted(set(skip)))
        return SpeculativeConfig(method, k, skip_layers=skip, **gate)
    if method == "draft_model":
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model' (the drafter's checkpoint)")
        return SpeculativeConfig(method, k, model=model, **gate)
    if method == "replay":
        p = raw.get("acceptance_prob", 0.8)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"speculative_config: acceptance_prob must be a number in [0, 1], got {p!r}")
        seed = raw.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"speculative_config: seed must be an integer, got {seed!r}")
        forced = raw.get("forced", False)
        if not isinstance(forced, bool):
            raise ValueError(f"speculative_config: forced must be true or false, got {forced!r}")
        return SpeculativeConfig(method, k, acceptance_prob=float(p), seed=seed, forced=forced, bench=True, **gate)
    return SpeculativeConfig(method, k, **gate)
