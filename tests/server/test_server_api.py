"""The OpenAI-compatible API through the official `openai` client against a real `lamina serve` process.

Greedy decoding wherever text is compared; max_tokens stays small (2-core CPU).
"""
from __future__ import annotations

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, MODEL, wait_idle

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def _tokens(server, text: str) -> list[int]:
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": text})
    assert r.status_code == 200
    return r.json()["tokens"]


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == MAX_MODEL_LEN


def test_completion_matches_offline_engine(client, llm_engine):
    """The server must produce exactly what the engine produces offline for the same greedy request."""
    from lamina import SamplingParams
    from lamina.engine.output_processor import OutputProcessor

    params = SamplingParams(temperature=0, max_tokens=12)
    llm_engine.add_request("offline", PROMPT, params)
    text_side = OutputProcessor(llm_engine.tokenizer)  # the engine emits token ids; this makes the text
    text_side.add("offline", params)
    want = None
    while llm_engine.has_unfinished_requests():
        for o in llm_engine.step():
            o, _ = text_side.process(o)
            want = o.outputs[0] if o is not None and o.finished else want
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids)


def test_completion_usage_and_streaming_agree(client, server):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == len(_tokens(server, PROMPT))
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == 10

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_prompt_as_token_ids_and_batch(client, server):
    ids = _tokens(server, PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    other = "One, two, three,"
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, other], max_tokens=6, temperature=0)
    single = client.completions.create(model=MODEL, prompt=other, max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [by_text.choices[0].text, single.choices[0].text]
    assert batch.usage.prompt_tokens == by_text.usage.prompt_tokens + single.usage.prompt_tokens


def test_chat_streaming_equals_non_streaming(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 10  # the template adds a system turn

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_n_samples(client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text
    sampled = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, n=3,
                                             seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert sampled.usage.completion_tokens == 24
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, n=3,
                                           seed=7, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in sampled.choices]
    assert len({c.message.content for c in sampled.choices}) > 1  # different samples, not n copies

    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, n=2, stream=True)
    texts = {0: "", 1: ""}
    finished = set()
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and texts[0] == texts[1] == greedy.choices[0].text[:len(texts[0])]


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # A stop string taken from the middle of the greedy text: the reply must end right before it.
    stop = base[len(base) // 2:len(base) // 2 + 2]
    assert stop.strip(), f"degenerate greedy text {base!r}"
    cut = base[:base.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == cut


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely token
        assert top[tok] == pytest.approx(chosen, abs=1e-6)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
        assert bytes(t.bytes).decode() == t.token
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)


def test_sampling_extras_and_seed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.9, seed=1234,
              presence_penalty=0.5, frequency_penalty=0.5,
              extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 8


def test_prefix_cache_hits_are_counted(client, server):
    """A repeated prompt is served from the prefix cache, and /metrics says so (used by the benchmarks to
    show their figures are not cache hits)."""
    prompt = "Once upon a time, " * 12  # ~60 tokens: three full 16-token blocks
    m0 = wait_idle(server.base_url)
    before = m0["lamina:prefix_cache_hits_total"]
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    mid = wait_idle(server.base_url)["lamina:prefix_cache_hits_total"]
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    m1 = wait_idle(server.base_url)
    after = m1["lamina:prefix_cache_hits_total"]
    assert m1["lamina:prefix_cache_queries_total"] - m0["lamina:prefix_cache_queries_total"] == \
        first.usage.prompt_tokens + second.usage.prompt_tokens
    assert mid == before  # a prompt never seen before is not a hit
    assert 32 <= after - mid < first.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == after - mid


def test_tokenize_detokenize(server):
    ids = _tokens(server, "Hello world")
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] == len(chat["tokens"]) > len(_tokens(server, CHAT[0]["content"]))
    assert chat["max_model_len"] == MAX_MODEL_LEN


def test_left_idle(server):
    m = wait_idle(server.base_url)
    assert m["lamina:generation_tokens_total"] > 0 and m["lamina:prompt_tokens_total"] > 0
    assert m["lamina:time_to_first_token_seconds_count"] > 0
    assert m["lamina:e2e_request_latency_seconds_count"] > 0
    assert m["lamina:inter_token_latency_seconds_count"] > 0
