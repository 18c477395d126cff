"""What the request bodies of every API (OpenAI completions and chat, Anthropic Messages, OpenAI Responses)
share: their pydantic base, and the building of SamplingParams from their fields."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from lamina.sampling_params import SamplingParams
from lamina.server.errors import bad_request


class Body(BaseModel):
    # Unknown fields are ignored, as vLLM and most compatible servers do. NaN/inf would slip past range
    # checks written as comparisons, so they are refused at parse time.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def model_defaults(defaults: dict[str, Any] | None, **values: Any) -> dict[str, Any]:
    """The request's sampling values where it set them, else the model's default (its generation config),
    else none (SamplingParams' own default applies)."""
    d = defaults or {}
    out = {k: v if v is not None else d.get(k) for k, v in values.items()}
    return {k: v for k, v in out.items() if v is not None}


def checked_params(vocab_size: int | None, rename: dict[str, str] | None = None, **fields: Any) -> SamplingParams:
    """SamplingParams(**fields), validated against the vocabulary (when vocab_size is given); a bad value is
    a 400 naming the request's field (rename: SamplingParams' name for it -> the API's)."""
    try:
        params = SamplingParams(**fields)
        params.validate(vocab_size)
    except (ValueError, TypeError) as e:
        param = getattr(e, "param", None)
        raise bad_request(str(e), (rename or {}).get(param, param)) from None
    return params
