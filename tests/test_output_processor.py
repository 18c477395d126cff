"""The output side (engine/output_processor.py): text from token ids, stop strings that span tokens, text
held back while it could still become a stop string, the cut sample's tokens and logprobs, logprob token
strings. The oracle is the tokenizer itself (decoding the whole output at once)."""
from __future__ import annotations

import pytest

from lamina.engine.output_processor import OutputProcessor
from lamina.outputs import CompletionOutput, Logprob, RequestOutput
from lamina.sampling_params import SamplingParams

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tok(smol_tokenizer):
    return smol_tokenizer


def _outputs(ids: list[int], step: int = 1, n: int = 1, logprobs: bool = False, finish: str | None = "length"):
    """The core's cumulative outputs of one request, `step` tokens at a time (several: accepted drafts)."""
    outs = []
    for end in range(step, len(ids) + step, step):
        end = min(end, len(ids))
        done = end == len(ids) and finish is not None
        lps = [{t: Logprob(-0.25 * (i + 1), 1, None)} for i, t in enumerate(ids[:end])] if logprobs else None
        comps = [CompletionOutput(i, "", list(ids[:end]), -1.0 if logprobs else None,
                                  None if lps is None else list(lps), finish if done else None) for i in range(n)]
        outs.append(RequestOutput("r", None, list(PROMPT), comps, done))
    return outs


def _run(proc: OutputProcessor, params: SamplingParams, outs: list[RequestOutput]):
    proc.add("r", params)
    shown, stops = [], []
    for out in outs:
        got, cut = proc.process(out)
        if got is None:
            break
        shown.append(got)
        stops += cut
    return shown, stops


def _text_ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("step", [1, 3])
def test_stop_string_spanning_tokens_cuts_text_and_tokens(tok, step):
    ids = _text_ids(tok, "The quick brown fox jumps over the lazy dog and runs far away from here")
    full = tok.decode(ids)
    stop = "fox jum"  # spans " fox" and " jumps"
    k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    assert tok.decode(ids[k - 1:k]).strip() not in stop, "the stop must end inside a token, not at its end"
    proc = OutputProcessor(tok)
    shown, stops = _run(proc, SamplingParams(stop=[stop], max_tokens=100, logprobs=0),
                        _outputs(ids, step, logprobs=True))
    last = shown[-1]
    assert last.finished and "r" not in proc
    comp = last.outputs[0]
    assert comp.text == full[:full.index(stop)] and comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.token_ids == ids[:k] and len(comp.logprobs) == k  # usage counts what was shown
    assert comp.cumulative_logprob == pytest.approx(sum(-0.25 * (i + 1) for i in range(k)))
    assert [(s.request_id, s.index, s.num_tokens, s.stop) for s in stops] == [("r", 0, k, stop)]
    for earlier, later in zip(shown, shown[1:]):  # streamed text only grows, and never shows the stop's start
        assert later.outputs[0].text.startswith(earlier.outputs[0].text)
    assert all(not o.outputs[0].text.endswith("fox") for o in shown)


def test_include_stop_str_and_held_back_text(tok):
    ids = _text_ids(tok, "one two three four five six seven")
    full = tok.decode(ids)
    proc = OutputProcessor(tok)
    shown, _ = _run(proc, SamplingParams(stop=["four fi"], include_stop_str_in_output=True), _outputs(ids))
    assert shown[-1].outputs[0].text == full[:full.index("four fi") + len("four fi")]
    # While "four" is out but " fi" is not, "four" could still start the stop: it is held back.
    k4 = next(k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]).endswith("four"))
    assert shown[k4 - 1].outputs[0].text == full[:full.index("four")]


def test_no_stop_strings_text_equals_a_whole_decode(tok):
    ids = _text_ids(tok, "Caf\u00e9 na\u00efve \u4f60\u597d emoji \U0001f600 done")
    full = tok.decode(ids)
    for step in (1, 2, len(ids)):
        shown, stops = _run(OutputProcessor(tok), SamplingParams(max_tokens=100), _outputs(ids, step))
        assert shown[-1].outputs[0].text == full and not stops
        assert all("\ufffd" not in o.outputs[0].text for o in shown)  # never a broken character mid-stream


def test_min_tokens_delays_stop_strings(tok):
    ids = _text_ids(tok, "a b a b a b a b")
    full = tok.decode(ids)
    shown, _ = _run(OutputProcessor(tok), SamplingParams(stop=["b"], min_tokens=3, max_tokens=100), _outputs(ids))
    comp = shown[-1].outputs[0]
    # The first "b" came before min_tokens: the cut is at the next one.
    assert comp.finish_reason == "stop" and len(comp.token_ids) == 4 and comp.text == full[:full.index("b", 3)]


def test_n_samples_finish_independently_and_the_request_when_all_have(tok):
    ids = _text_ids(tok, "alpha beta gamma delta")
    proc = OutputProcessor(tok)
    proc.add("r", SamplingParams(n=2, stop=["gamma"], max_tokens=100))
    outs = _outputs(ids, n=2, finish=None)
    k = next(k for k in range(1, len(ids) + 1) if "gamma" in tok.decode(ids[:k]))
    for out in outs[:k - 1]:  # sample 1 runs ahead to a different token stream: only sample 0 stops
        out.outputs[1].token_ids = ids[:1] * len(out.outputs[1].token_ids)
    outs[k - 1].outputs[1].token_ids = ids[:1] * k
    got, stops = None, []
    for out in outs[:k]:
        got, cut = proc.process(out)
        stops += cut
    assert not got.finished and got.outputs[0].finish_reason == "stop" and got.outputs[1].finish_reason is None
    assert [(s.index, s.num_tokens) for s in stops] == [(0, k)]
    # The core keeps producing tokens for sample 0 until it sees the stop: they are never shown.
    later = RequestOutput("r", None, list(PROMPT), [CompletionOutput(0, "", ids[:k + 2], None, None),
                                                    CompletionOutput(1, "", ids[:1] * (k + 1), None, None, "length")],
                          False)
    got, cut = proc.process(later)
    assert got.finished and got.outputs[0].token_ids == ids[:k] and not cut and "r" not in proc


def test_logprob_token_strings_are_filled(tok):
    ids = _text_ids(tok, "Hello there")
    out = _outputs(ids, logprobs=True)[-1]
    out.outputs[0].logprobs[0][7] = Logprob(-3.0, 2, None)
    out.prompt_logprobs = [None, {2: Logprob(-1.0, 1, None)}, {3: Logprob(-1.0, 1, None)}]
    proc = OutputProcessor(tok)
    proc.add("r", SamplingParams(logprobs=1, prompt_logprobs=0))
    got, _ = proc.process(out)
    for entry in got.outputs[0].logprobs + got.prompt_logprobs[1:]:
        for tid, lp in entry.items():
            assert lp.decoded_token == tok.decode([tid], skip_special_tokens=False)


def test_unknown_and_finished_requests_are_ignored(tok):
    proc = OutputProcessor(tok)
    assert proc.process(_outputs([5])[0]) == (None, [])
    shown, _ = _run(proc, SamplingParams(), _outputs([5, 6]))
    assert shown[-1].finished and len(proc) == 0
