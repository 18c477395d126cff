"""vLLM's extensions on /v1/completions and /v1/chat/completions, through the `openai` client (extra_body)
against a real server. Oracles: /tokenize and /detokenize of the same server, the same request without the
extension, and the prompt-logprob pass agreeing with echo's logprobs."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import MODEL, serve_in_thread, wait_idle

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def _tokens(server, **body) -> list[int]:
    r = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_prompt_logprobs_and_echo_with_logprobs(client, server):
    ids = _tokens(server, prompt=PROMPT)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None  # present, null when not asked
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
                                  extra_body={"prompt_logprobs": 1, "ignore_eos": True})
    c = r.choices[0]
    plp = c.model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    assert all(str(t) in pos for t, pos in zip(ids[1:], plp[1:]))  # the prompt's own token is listed
    lp = c.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([plp[i][str(t)]["logprob"] for i, t in enumerate(ids) if i])
    assert "".join(lp.tokens) == c.text and c.text == PROMPT + plain.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 3)]
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                              echo=True, stream=True, extra_body={"ignore_eos": True}))
    s_tokens = [t for ch in streamed for t in ch.choices[0].logprobs.tokens]
    assert s_tokens == lp.tokens and "".join(ch.choices[0].text for ch in streamed) == c.text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": -1})


def test_return_token_ids_and_tokens_as_ids(client, server):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                  extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    c = r.choices[0]
    assert c.model_extra["prompt_token_ids"] == _tokens(server, prompt=PROMPT)
    out = c.model_extra["token_ids"]
    assert len(out) == r.usage.completion_tokens
    assert httpx.post(server.base_url + "/detokenize", json={"tokens": out}).json()["prompt"] == c.text
    assert c.logprobs.tokens == [f"token_id:{t}" for t in out]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == _tokens(server, messages=CHAT)
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [t for ch in chunks for t in (ch.choices[0].model_extra.get("token_ids") or [])] == \
        chat.choices[0].model_extra["token_ids"]


def test_truncate_prompt_tokens(client, server):
    ids = _tokens(server, prompt=PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 3})
    tail = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == tail.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"truncate_prompt_tokens": 0})


def test_continuous_usage_and_one_choice_per_chunk(client, server):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, n=2, temperature=1.0, seed=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    body = [c for c in chunks if c.choices]
    assert all(len(c.choices) == 1 for c in body) and {c.choices[0].index for c in body} == {0, 1}
    used = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and used == sorted(used) and used[-1] == 8
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == body[0].usage.prompt_tokens
    comp = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, stream=True,
                                          extra_body={"ignore_eos": True}))
    assert all(len(c.choices) == 1 for c in comp)
    wait_idle(server.base_url)


def test_chat_template_controls(client, server):
    msgs = [*CHAT, {"role": "assistant", "content": "The three colors are"}]
    cont = dict(add_generation_prompt=False, continue_final_message=True)
    ids = _tokens(server, messages=msgs, **cont)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                       extra_body={**cont, "echo": True})
    raw = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert r.choices[0].message.content == "The three colors are" + raw.choices[0].text
    assert r.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError):  # both at once is a contradiction
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                       extra_body={"continue_final_message": True})
    odd = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "critic", "content": "hi"}])
    assert odd.usage.prompt_tokens == len(_tokens(server, messages=[{"role": "critic", "content": "hi"}]))


def test_out_of_vocabulary_wording(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1, 2, 10**6], max_tokens=1)
    assert "out of vocabulary" in e.value.body["message"]


def test_usage_is_openais_by_default(llm_engine):
    from lamina.server.app import build_app, make_state

    with serve_in_thread(build_app(make_state(llm_engine, [MODEL]))) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert r.usage.prompt_tokens_details is None
    with serve_in_thread(build_app(make_state(llm_engine, [MODEL], prompt_tokens_details=True))) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        assert c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage.prompt_tokens_details is not None
