"""What users get back: text, stop strings and ids, n > 1, logprobs and prompt logprobs, detokenization."""
from __future__ import annotations

import pytest

from lamina import LLM, SamplingParams
from lamina.engine.detokenizer import Detokenizer, initial_state

PROMPT = {"prompt_token_ids": [1000 + 37 * i for i in range(12)]}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def llm(checkpoints, request):
    # overlap: tokens read back one step late (the GPU default); stops must still cut at the right token.
    return LLM(model=str(checkpoints["qwen3"]), dtype="float32", device="cpu", num_kv_blocks=128, progress=False,
               async_scheduling=request.param)


def greedy(llm, **kw):
    return llm.generate(PROMPT, SamplingParams(temperature=0, ignore_eos=True, **kw), use_tqdm=False)[0]


def test_stop_string_cuts_text(llm):
    full = greedy(llm, max_tokens=30).outputs[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    cut = greedy(llm, max_tokens=30, stop=[stop]).outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = greedy(llm, max_tokens=30, stop=[stop], include_stop_str_in_output=True).outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    full = greedy(llm, max_tokens=20).outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    target = full.token_ids[7]
    first = full.token_ids.index(target)
    out = greedy(llm, max_tokens=20, stop_token_ids=[target]).outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_n_samples(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3
    again = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_logprobs_shape(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2,
                                              ignore_eos=True), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for tok, pos in zip(comp.token_ids, comp.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(pos) <= 4 and all(lp.logprob <= 0 for lp in pos.values())
    assert comp.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(comp.token_ids, comp.logprobs)))
    ids = PROMPT["prompt_token_ids"]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        assert ids[i] in out.prompt_logprobs[i] and len(out.prompt_logprobs[i]) in (2, 3)


def test_text_prompt_and_token_prompt_agree(llm):
    tok = llm.get_tokenizer()
    a = llm.generate("Hello there, how are", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": tok("Hello there, how are").input_ids},
                     SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.prompt == "Hello there, how are"


def test_incremental_detokenization_never_breaks_characters(smol_tokenizer):
    text = "Grüße aus Köln! 你好，世界。 Emoji: 🦙🚀 naïve café — done."
    ids = smol_tokenizer(text).input_ids
    prompt = smol_tokenizer("Say:").input_ids
    detok = Detokenizer(smol_tokenizer)
    state = initial_state(len(prompt))
    tokens = list(prompt)
    pieces = []
    for t in ids:
        tokens.append(t)
        pieces.append(detok.step(state, tokens, True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == smol_tokenizer.decode(ids)
    assert sum(1 for p in pieces if p == "") > 0  # some tokens were split characters, held back


def test_stop_strings_end_samples_and_free_their_blocks(llm):
    """Offline, through the same output side as the server: each sample is cut at its own stop string, its
    token ids end at the token that completed it, and nothing is left leased."""
    full = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0]
    stop = full.outputs[0].text[10:13]
    assert stop.strip()
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True,
                                              stop=[stop]), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    for ref, comp in zip(full.outputs, out.outputs):
        if stop not in ref.text:
            assert comp.text == ref.text and comp.token_ids == ref.token_ids
            continue
        assert comp.finish_reason == "stop" and comp.text == ref.text[:ref.text.index(stop)]
        k = next(k for k in range(1, len(ref.token_ids) + 1) if stop in tok.decode(ref.token_ids[:k]))
        assert comp.token_ids == ref.token_ids[:k]
    s = llm.engine.stats()
    assert not llm.engine.has_unfinished_requests() and s.num_free_blocks == s.num_total_blocks
