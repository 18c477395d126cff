"""The bitmask filled on a worker thread while the step is built and its forward runs (structured/fill.py):
the filler against jobs run in order, the manager's background fill against each matcher filled on its own
(with multi-token bad words on a grammar row), and the engine's outputs with the fill overlapped equal to
the fill after the forward and to the synchronous engine (greedy), at batch 1 and 16, mixed batches."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from lamina import SamplingParams
from lamina.engine.inflight import InFlight
from lamina.structured.fill import ROWS_PER_THREAD, MaskFiller, batch_threads, default_fill_threads
from lamina.structured.params import StructuredOutputsParams as SO

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}}}


def test_thread_counts(monkeypatch):
    assert batch_threads(ROWS_PER_THREAD - 1, 8) == 1  # few rows: one thread
    assert batch_threads(4 * ROWS_PER_THREAD, 8) == 4  # sized to the rows
    assert batch_threads(64 * ROWS_PER_THREAD, 8) == 8  # capped
    assert batch_threads(64, 0) == 1
    monkeypatch.setenv("LAMINA_GRAMMAR_FILL_THREADS", "3")
    assert default_fill_threads() == 3
    monkeypatch.setenv("LAMINA_GRAMMAR_FILL_THREADS", "-1")
    with pytest.raises(ValueError, match="LAMINA_GRAMMAR_FILL_THREADS"):
        default_fill_threads()
    monkeypatch.delenv("LAMINA_GRAMMAR_FILL_THREADS")
    assert 1 <= default_fill_threads() <= 8
    monkeypatch.setenv("LAMINA_GRAMMAR_FILL_MIN_ROWS", "1")
    assert MaskFiller(2).min_rows == 1
    monkeypatch.setenv("LAMINA_GRAMMAR_FILL_MIN_ROWS", "0")
    with pytest.raises(ValueError, match="LAMINA_GRAMMAR_FILL_MIN_ROWS"):
        MaskFiller(2)
    monkeypatch.delenv("LAMINA_GRAMMAR_FILL_MIN_ROWS")
    assert MaskFiller(2).min_rows == ROWS_PER_THREAD


@pytest.mark.parametrize("threads,background", [(0, True), (2, True), (2, False), (3, False)])
def test_filler_runs_every_job_once_and_reraises(threads, background):
    filler = MaskFiller(threads)
    seen, where = [], set()
    host = torch.empty(0)

    def job(i):
        seen.append(i)
        where.add(threading.current_thread().name)

    filler.start(host, [], [], [lambda i=i: job(i) for i in range(40)], 40, background).wait()
    assert seen == list(range(40))  # in order, on one thread
    if threads and background:  # one hand-off: the worker ran them all
        assert len(where) == 1 and threading.current_thread().name not in where
        where.clear()
        filler.start(host, [], [], [lambda: job(-1)], ROWS_PER_THREAD - 1, background).wait()  # few rows: here
    assert where == {threading.current_thread().name}

    def bad():
        raise RuntimeError("fill failed")

    pending = filler.start(host, [], [], [bad] + [lambda: None] * 20, 21, background)
    with pytest.raises(RuntimeError, match="fill failed"):
        pending.wait()
    filler.close()


def _tokenizer():
    from lamina.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_source

    return load_tokenizer(resolve_source(DEFAULT_MODEL))


def test_background_fill_equals_each_matcher_and_keeps_bad_words():
    """20 single-row grammars (one batch fill on the worker, two xgrammar threads), a verify run, and a
    grammar row that also has a multi-token bad word: the mask is each matcher's own fill, with the bad
    word's last token banned too."""
    pytest.importorskip("xgrammar")
    from lamina.structured.manager import StructuredOutputManager
    from lamina.structured.state import GrammarState

    tok = _tokenizer()
    mgr = StructuredOutputManager(tok, len(tok), [tok.eos_token_id], torch.device("cpu"))
    mgr._filler = MaskFiller(2)
    compiled = mgr.compiler.compile(SO(json={"type": "object", "properties": {"a": {"type": "string"}},
                                             "required": ["a"]}))
    texts = ['{"a": "x', '{"a', "", '{"a": "yz'] * 5
    seqs = []
    for text in texts:
        st = GrammarState(compiled)
        for t in tok(text, add_special_tokens=False).input_ids:
            assert st.accept(t)
        seqs.append(SimpleNamespace(grammar=st, finished=False, draft_token_ids=[], params=SamplingParams(),
                                    output_token_ids=[]))
    inside = seqs[0]  # inside a string: nearly every token allowed, so a ban shows
    out = tok(' hello', add_special_tokens=False).input_ids
    word = out + [tok(' world', add_special_tokens=False).input_ids[0]]
    inside.params = SamplingParams(bad_words=["x"])
    inside.params.bad_words_token_ids = [word]
    inside.output_token_ids = list(out)
    verify = seqs[1]
    verify.draft_token_ids = tok('": "', add_special_tokens=False).input_ids[:2]
    rows = [seqs[0], verify, verify, verify] + seqs[2:]
    offsets = [0, 0, 1, 2] + [0] * (len(seqs) - 2)
    pending = mgr.start_bitmask(rows, offsets, background=True)
    got = pending.result().bitmask.clone()
    want = torch.full((len(rows), got.shape[1]), -1, dtype=torch.int32)
    inside.grammar.matcher.fill_next_token_bitmask(want, 0)
    verify.grammar.fill(want, 1, verify.draft_token_ids, 3)
    for i, seq in enumerate(seqs[2:]):
        seq.grammar.matcher.fill_next_token_bitmask(want, 4 + i)
    last = word[-1]
    assert want[0, last // 32] >> (last % 32) & 1  # the grammar allows it ...
    want[0, last // 32] &= ~(1 << (last % 32)) if last % 32 != 31 else 0x7FFFFFFF  # ... the bad word does not
    assert torch.equal(got, want)
    mgr.close()


def _pipe_fillers(wait_start):
    """The fillers whose masks must equal the default's (first): accepts on the loop, and fill_pipe.py's
    batch accept on the worker, on the loop, and filled on the calling thread."""
    return [MaskFiller(2, min_rows=1), MaskFiller(2, min_rows=1, wait_start=wait_start, accept_on_loop=True,
                                                  switch_us=100),
            MaskFiller(2, min_rows=1, pipe=True, switch_us=100), MaskFiller(2, min_rows=1, pipe=True,
                                                                            accept_on_loop=True),
            MaskFiller(2, min_rows=64, pipe=True)]


@pytest.mark.parametrize("wait_start", [True, False])
def test_accepts_on_the_loop_fill_as_on_the_worker(wait_start):
    """LAMINA_GRAMMAR_FILL_ACCEPT_ON_LOOP and LAMINA_GRAMMAR_FILL_PIPE: queued tokens (one a row, one row given
    its stop token, one several, one a token its grammar rejects) taken on the calling thread or in one batch
    call, then the batch fill: the same mask and states as the worker taking them one by one (the default),
    and the switch interval lowered while the fill is pending is put back by wait()."""
    import sys

    pytest.importorskip("xgrammar")
    from lamina.structured.state import GrammarState

    tok = _tokenizer()
    from lamina.structured.compiler import GrammarCompilerService

    compiled = GrammarCompilerService(tok, len(tok), [tok.eos_token_id]).compile(SO(json=SCHEMA))
    prefixes = ['{"name": "a', '{"name": "bc", "age": 4', '{"name', "", '{"name": "x", "age": 1}', '{"name": 7'] * 3
    queued = [tok(p, add_special_tokens=False).input_ids for p in prefixes]
    width = (len(tok) + 31) // 32
    masks, ends = [], []
    for filler in _pipe_fillers(wait_start):
        states = [GrammarState(compiled) for _ in queued]
        for st, ids in zip(states, queued):
            for t in ids[:-1]:
                assert st.accept(t) or st.broken
            if ids:
                st.push(ids[-1])  # the last one queued, as the read-back leaves it
        states[4].push(tok.eos_token_id)  # a complete object, then its stop token: the row goes all ones
        states[2].pending = list(queued[2])  # several queued (the matcher had none of them)
        states[2].matcher.reset()
        states[2].num_accepted = 0
        host = torch.zeros((len(states), width), dtype=torch.int32)
        before = sys.getswitchinterval()
        pending = filler.start(host, states, list(range(len(states))), [], len(states))
        pending.wait()
        assert sys.getswitchinterval() == before
        assert states[4].done and not any(s.pending for s in states)
        masks.append(host.clone())
        ends.append([(s.done, s.broken, s.num_accepted) for s in states])
        filler.close()
    for m, e in zip(masks[1:], ends[1:]):
        assert torch.equal(masks[0], m) and e == ends[0]
    assert (masks[0][4] == -1).all() and not (masks[0][0] == -1).all()
    assert ends[0][5][1] and (masks[0][5] == -1).all()  # '7' where a string must start: rejected, unmasked


# ---- the engine: overlapped fill, fill after the forward, synchronous loop ------------------------------
@pytest.fixture(scope="module")
def engines():
    from lamina.config import EngineConfig
    from lamina.engine.engine import LLMEngine
    from lamina.models.loader import DEFAULT_MODEL

    def make(async_scheduling):
        return LLMEngine(EngineConfig(model=DEFAULT_MODEL, dtype="float32", device="cpu", dequantize_gguf=True,
                                      async_scheduling=async_scheduling), progress=False)

    overlapped = make(True)
    overlapped.structured._filler = MaskFiller(2)  # 16 rows: one batch fill, two xgrammar threads
    return overlapped, make(False)


def _run(eng, prompts, params_of):
    from lamina.llm import chat_prompt_ids

    for i, p in enumerate(prompts):
        eng.add_request(str(i), chat_prompt_ids(eng.tokenizer, [{"role": "user", "content": p}]), params_of(i))
    seqs = {str(i): eng.groups[str(i)].seqs[0] for i in range(len(prompts))}
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        assert steps < 1000
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running
    return {rid: (s.output_token_ids, s.finish_reason) for rid, s in seqs.items()}


@pytest.mark.parametrize("batch,mixed", [(1, False), (16, False), (16, True)])
def test_overlapped_fill_equals_fill_after_forward_and_sync(engines, monkeypatch, batch, mixed):
    overlapped, sync = engines
    prompts = [f"Invent person {i} with a name and an age, as JSON." for i in range(batch)]

    def params_of(i):
        constrained = not mixed or i % 2 == 0
        return SamplingParams(temperature=0, max_tokens=40 if constrained else 12,
                              structured_outputs=SO(json=SCHEMA) if constrained else None)

    early = _run(overlapped, prompts, params_of)  # CPU tokens are always on the host: the fill overlaps
    monkeypatch.setattr(InFlight, "ready", lambda self: False)  # as a GPU still busy with the step in flight
    late = _run(overlapped, prompts, params_of)
    monkeypatch.undo()
    assert early == late == _run(sync, prompts, params_of)
    for i, (ids, reason) in enumerate(early.values()):
        if mixed and i % 2:
            continue
        assert reason == "stop", ids
        jsonschema.validate(json.loads(overlapped.tokenizer.decode(ids, skip_special_tokens=True)), SCHEMA)


@pytest.mark.parametrize("mode", ["accept_on_loop", "pipe"])
def test_opt_in_fill_modes_in_the_engine_equal_sync(engines, mode):
    """The opt-in fill modes in the engine: accepts on the step loop (no wait for the worker's start, a lowered
    switch interval), and LAMINA_GRAMMAR_FILL_PIPE (one batch accept and one batch fill on a worker the loop
    does not wait for). The same tokens as the synchronous loop, 16 rows of which half are constrained, and
    every constrained output valid against the schema."""
    overlapped, sync = engines
    prompts = [f"Invent person {i} with a name and an age, as JSON." for i in range(16)]

    def params_of(i):
        return SamplingParams(temperature=0, max_tokens=40 if i % 2 == 0 else 12,
                              structured_outputs=SO(json=SCHEMA) if i % 2 == 0 else None)

    default = overlapped.structured._filler
    overlapped.structured._filler = (
        MaskFiller(2, min_rows=1, wait_start=False, accept_on_loop=True, switch_us=100) if mode == "accept_on_loop"
        else MaskFiller(2, min_rows=1, pipe=True))
    try:
        got = _run(overlapped, prompts, params_of)
    finally:
        overlapped.structured._filler.close()
        overlapped.structured._filler = default
    assert got == _run(sync, prompts, params_of)
    for i, (ids, reason) in enumerate(got.values()):
        if i % 2 == 0:
            assert reason == "stop", ids
            jsonschema.validate(json.loads(overlapped.tokenizer.decode(ids, skip_special_tokens=True)), SCHEMA)


def test_overlapped_steps_do_overlap(engines, monkeypatch):
    """With the async loop on, every constrained step after the first starts its fill before the forward
    (the early read back), so the fill and the forward run at the same time."""
    overlapped, _ = engines
    order = []
    mgr = overlapped.structured
    start, execute = mgr.start_bitmask, overlapped.runner.execute
    monkeypatch.setattr(mgr, "start_bitmask", lambda *a, **k: (order.append(("fill", k.get("background", True))),
                                                                start(*a, **k))[1])
    monkeypatch.setattr(overlapped.runner, "execute", lambda b: (order.append(("forward",)), execute(b))[1])
    _run(overlapped, ["A person as JSON."], lambda i: SamplingParams(temperature=0, max_tokens=20,
                                                                     structured_outputs=SO(json=SCHEMA)))
    fills = [i for i, o in enumerate(order) if o[0] == "fill"]
    assert len(fills) > 5 and all(order[i] == ("fill", True) and order[i + 1] == ("forward",) for i in fills)


def test_decode_fast_path_equals_general_path(monkeypatch):
    """start_bitmask's one-loop path (every row one live grammar, nothing else) gives the general path's mask,
    and sampled_rows lays rows out as before (0, 1 and 3 sampled rows)."""
    pytest.importorskip("xgrammar")
    from lamina.structured import manager as mg
    from lamina.structured.state import GrammarState

    item = [SimpleNamespace(seq=s, num_sampled=n) for s, n in (("a", 1), ("b", 0), ("c", 3), ("d", 1))]
    assert mg.sampled_rows(item) == (["a", "c", "c", "c", "d"], [0, 0, 1, 2, 0])
    tok = _tokenizer()
    mgr = mg.StructuredOutputManager(tok, len(tok), [tok.eos_token_id], torch.device("cpu"))
    compiled = mgr.compiler.compile(SO(json=SCHEMA))
    masks = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(mg, "_decode_states", lambda rows, offsets: None)
        seqs = []
        for text in ['{"name": "a', '{"name": "bc", "age": 4', ""] * 4:
            st = GrammarState(compiled)
            for t in tok(text, add_special_tokens=False).input_ids:
                st.push(t)
            seqs.append(SimpleNamespace(grammar=st, finished=False, draft_token_ids=[], params=SamplingParams(),
                                        output_token_ids=[]))
        assert (mg._decode_states(seqs, [0] * len(seqs)) is not None) == fast
        mask = mgr.start_bitmask(seqs, [0] * len(seqs), background=True).result()
        assert mask.rows is None and mask.host_rows == list(range(len(seqs)))
        masks.append(mask.bitmask.clone())
    assert torch.equal(masks[0], masks[1])
    mgr.close()
