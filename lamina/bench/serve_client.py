"""The load side of `lamina bench serve`: prompts, and one timed streaming request against an OpenAI-compatible
server (completions or chat), measured the way vLLM's serving benchmark measures it."""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field

import httpx

# Common short English words, nearly all one token in BPE vocabularies: "words" prompts of N words come
# out near N tokens on any model, and the server's usage says the exact count.
_WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one "
          "had by word but not what all were we when your can said there use an each which she do how their "
          "if will up other about out many then them these so some her would make like him into time has look "
          "two more write go see number no way could people my than first water been call who oil its now find "
          "long down day did get come made may part over new sound take only little work know place year live "
          "me back give most very after thing our just name good sentence man think say great where help "
          "through much before line right too mean old any same tell boy follow came want show also around form "
          "three small set put end does another well large must big even such because turn here why ask went "
          "men read need land different home us move try kind hand picture again change off play spell air away "
          "animal house point page letter mother answer found study still learn should world high").split()


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # as built; the server's usage is what the results report
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first chunk carrying text
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between later text chunks
    start: float = 0.0


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)], as vLLM's --random-range-ratio."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_requests(num: int, input_len: int, output_len: int, range_ratio: float, prompt_type: str,
                  vocab_size: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    ins, outs = _lengths(rng, num, input_len, range_ratio), _lengths(rng, num, output_len, range_ratio)
    reqs = []
    for n_in, n_out in zip(ins, outs):
        if prompt_type == "ids":
            # Above the low ids, where tokenizers keep their special tokens.
            prompt: str | list[int] = [rng.randrange(1000, vocab_size) for _ in range(n_in)]
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(n_in))
        reqs.append(BenchRequest(prompt, n_in, n_out))
    return reqs


@dataclass
class Target:
    base_url: str
    model: str
    endpoint: str  # "completions" or "chat"
    api_key: str | None
    ignore_eos: bool
    temperature: float
    extra_body: dict

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, req: BenchRequest) -> tuple[str, dict]:
        common = {"model": self.model, "max_tokens": req.output_len, "temperature": self.temperature,
                  "stream": True, "stream_options": {"include_usage": True}, **self.extra_body}
        if self.ignore_eos:
            common["ignore_eos"] = True  # vLLM/lamina extra: outputs get exactly the asked length
        if self.endpoint == "chat":
            prompt = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {**common, "prompt": req.prompt}


def _chunk_text(chunk: dict, chat: bool) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if chat:
            text += (choice.get("delta") or {}).get("content") or ""
        else:
            text += choice.get("text") or ""
    return text


async def send(client: httpx.AsyncClient, target: Target, req: BenchRequest) -> RequestResult:
    res = RequestResult(prompt_tokens=req.prompt_len)
    path, body = target.body(req)
    chat = target.endpoint == "chat"
    res.start = t0 = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", target.base_url + path, json=body, headers=target.headers()) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    return res
                now = time.perf_counter()
                if _chunk_text(chunk, chat):
                    if chunks == 0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    chunks += 1
                    last = now
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                    res.output_tokens = usage.get("completion_tokens", 0)
        res.latency = time.perf_counter() - t0
        if res.output_tokens == 0:
            res.output_tokens = chunks  # a server without include_usage: one token per chunk, at best
        res.ok = chunks > 0 or res.output_tokens > 0
        if not res.ok:
            res.error = "no output"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res
