"""A stand-in for vLLM in CPU tests of `--baseline vllm`: the few calls lamina/bench/vllm_runner.py makes, with
deterministic outputs and no model. Every token is id 7; each engine step emits one token per request; a
prompt's cached tokens are the longest block-aligned (16) prefix it shares with a prompt seen before.

Test switches (environment): FAKE_VLLM_LOG=path appends the LLM keyword arguments and the model's config.json
as one JSON line per engine; FAKE_VLLM_FAIL=1 makes building the engine raise a two-line error;
FAKE_VLLM_LINGER=s leaves a process behind that holds stdout open for s seconds (as an engine-core process
being shut down can)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.0.0+fake"
__all__ = ["LLM", "SamplingParams", "RequestOutputKind"]

_BLOCK = 16


@dataclass
class CompletionOutput:
    token_ids: list[int]


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    finished: bool


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    cached: int
    produced: int = 0


@dataclass
class _Engine:
    seen: list[list[int]] = field(default_factory=list)
    active: dict[str, _Request] = field(default_factory=dict)

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for other in self.seen:
            n = 0
            for a, b in zip(prompt, other):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self.seen.append(prompt)
        return min(best, len(prompt) - 1) // _BLOCK * _BLOCK

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> str:
        self.active[request_id] = _Request(list(prompt["prompt_token_ids"]), params,
                                           self._cached(list(prompt["prompt_token_ids"])))
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.active)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.002)
        outs = []
        for rid, req in list(self.active.items()):
            req.produced += 1
            done = req.produced >= req.params.max_tokens
            outs.append(RequestOutput(rid, [CompletionOutput([7])], req.cached, done))
            if done:
                del self.active[rid]
        return outs


class LLM:
    def __init__(self, **kwargs) -> None:
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("CUDA out of memory (fake)\nsecond line of the error")
        if os.environ.get("FAKE_VLLM_LOG"):
            cfg_path = Path(kwargs["model"]) / "config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else None
            with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
                f.write(json.dumps({"kwargs": kwargs, "config": cfg}) + "\n")
        if os.environ.get("FAKE_VLLM_LINGER"):
            subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({os.environ['FAKE_VLLM_LINGER']})"])
        self.llm_engine = _Engine()

    def generate(self, prompts: list[dict], params: list[SamplingParams], use_tqdm: bool = True) -> list[RequestOutput]:
        time.sleep(0.01)
        return [RequestOutput(str(i), [CompletionOutput([7] * p.max_tokens)], self.llm_engine._cached(
            list(prompt["prompt_token_ids"])), True) for i, (prompt, p) in enumerate(zip(prompts, params))]
