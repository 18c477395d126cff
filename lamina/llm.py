"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, params) and .chat(messages, params)."""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from lamina.config import EngineConfig
from lamina.engine.core import EngineCore
from lamina.engine.engine import LLMEngine
from lamina.engine.ipc import IterationStats
from lamina.engine.output_processor import OutputProcessor
from lamina.models.loader import DEFAULT_MODEL
from lamina.outputs import RequestOutput
from lamina.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, progress: bool = True, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), progress=progress)
        # In-process, but through the same core the server's engine process runs (without its channels);
        # generate() returns finished requests only, so the core does not stream every step's progress.
        self.core = EngineCore(self.engine, stream_outputs=False)
        # The output side, as behind the server: text, stop strings (same thread as the core: no lock).
        self.outputs = OutputProcessor(self.engine.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None
                 = None, use_tqdm: bool = True) -> list[RequestOutput]:
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: a string, a dict, or a bare list of token ids
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                rid = f"offline-{next(self._ids)}"
                self.core.add(rid, prompt, p)
                self.outputs.add(rid, p)
                ids.append(rid)
        except Exception:
            self._abort(ids)  # leave the engine as it was: nothing half-queued
            raise
        return self._run(ids, use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[RequestOutput]:
        """Runs one request, yielding its output (text so far) after every step that advanced it, the last
        one finished. Closing the iterator early (or an interrupt) aborts the request."""
        rid = request_id or f"stream-{next(self._ids)}"
        params = sampling_params or SamplingParams()
        self.core.add(rid, prompt, params)
        self.outputs.add(rid, params)
        streaming, self.engine.stream_outputs = self.engine.stream_outputs, True
        finished = False
        try:
            while not finished:
                for out in self._step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
        finally:
            self.engine.stream_outputs = streaming
            if not finished:
                self._abort([rid])

    def _step(self) -> list[RequestOutput]:
        """One core step seen through the output side: text made, stop strings applied, and the samples
        they end finished in the core at once (their blocks freed before the next step)."""
        it = IterationStats()
        raw = self.core.step(it, contain_failures=False)
        results = []
        while raw:
            stops = []
            for out in raw:
                shown, cut = self.outputs.process(out)
                if shown is not None:
                    results.append(shown)
                    stops += cut
            raw = self.core.stop_samples(stops, it) if stops else []
        return results

    def _abort(self, ids: list[str]) -> None:
        self.core.abort(ids)
        for rid in ids:
            self.outputs.forget(rid)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        try:
            while len(done) < len(ids):
                for out in self._step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            self._abort(list(wanted - done.keys()))
        return [done[rid] for rid in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        return chat_prompt_ids(self.engine.tokenizer, messages, add_generation_prompt)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [{"prompt_token_ids": self.apply_chat_template(c)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)


def chat_prompt_ids(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False) -> list[int]:
    """The chat template applied to messages (tools: function definitions the template renders;
    template_kwargs: extra template variables such as enable_thinking; continue_final_message: the last,
    assistant, message stays open for the reply to continue, vLLM's extension)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), (str, list)):
            raise ValueError("each message needs a 'role' and a string 'content'")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template")
    extra = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    if continue_final_message:
        extra["continue_final_message"], add_generation_prompt = True, False
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **extra)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)
