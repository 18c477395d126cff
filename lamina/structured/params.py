"""StructuredOutputsParams: one output constraint of a request, named as vLLM's `structured_outputs`.

Exactly one of json, regex, choice, grammar, json_object or structural_tag is set. The params are plain
data (they cross the process boundary inside SamplingParams as a dict) and carry no compiled state.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsError(ValueError):
    """A constraint that cannot be compiled (bad schema, regex or grammar); the server answers 400."""

    def __init__(self, message: str, param: str | None = "structured_outputs") -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):
        return (type(self), (str(self), self.param))


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF-style, as xgrammar reads it)
    json_object: bool | None = None  # any JSON object
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond what the compact form needs
    strict: bool = True  # JSON schema: properties it does not name may not appear (OpenAI's strict)

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise StructuredOutputsError(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got {', '.join(set_) or 'none'}")
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise StructuredOutputsError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool, bool]:
        """A hashable identity of the constraint (the compile cache's key, with the tokenizer's)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            value = json.dumps(value)
        elif kind == "json_object":
            value = ""
        return kind, value, self.disable_any_whitespace, self.strict

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict[str, Any] | None) -> StructuredOutputsParams | None:
        """Rebuilds the params from their dict form (as they cross processes), keeping only known fields."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise StructuredOutputsError(f"structured_outputs must be an object, got {type(value).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(value) - names
        if unknown:
            raise StructuredOutputsError(f"unknown structured_outputs fields: {', '.join(sorted(unknown))}")
        return cls(**value)
