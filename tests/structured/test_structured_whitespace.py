"""JSON whitespace bounded on the host (LAMINA_JSON_WHITESPACE_ON_HOST=1, structured/whitespace.py): the token
tables, the ban after a long run (and the grammar's row kept where the ban would empty it), the manager's
masks against the unbounded matcher's, and engine outputs that validate against their schema."""
from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import numpy as np
import torch

from lamina import SamplingParams
from lamina.structured.params import StructuredOutputsParams as SO
from lamina.structured.whitespace import MAX_RUN, WhitespaceTables, ban_long_runs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}}}


def _allowed(row: np.ndarray, t: int) -> bool:
    return bool((int(row[t // 32]) >> (t % 32)) & 1)


def test_tables_and_ban():
    vocab = [b"a", b" ", b"  \n", b" x", b"x  ", b"", b"\t", b"y"] + [b"z"] * 30
    tab = WhitespaceTables(vocab, len(vocab))
    assert tab.step[:8] == [0, -1, -3, 0, 2, 0, -1, 0]
    assert tab.run_after(0, [1, 2, 6]) == 5 and tab.run_after(5, [4]) == 2 and tab.run_after(9, [0]) == 0
    assert [_allowed(tab.keep, t) for t in range(8)] == [True, False, False, False, True, True, False, True]
    host = torch.full((2, tab.keep.shape[0]), -1, dtype=torch.int32)
    host[1].zero_()
    host[1, 0] = 0b110  # only whitespace-leading tokens 1 and 2: a ban would leave nothing
    ban_long_runs(host, [0, 1], [tab, tab])
    assert [_allowed(host[0].numpy(), t) for t in range(8)] == [True, False, False, False, True, True, False, True]
    assert host[1, 0] == 0b110


def test_manager_bans_whitespace_only_after_a_long_run(monkeypatch):
    monkeypatch.setenv("LAMINA_JSON_WHITESPACE_ON_HOST", "1")
    from lamina.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_source
    from lamina.structured.manager import StructuredOutputManager

    tok = load_tokenizer(resolve_source(DEFAULT_MODEL))
    vocab = len(tok)
    mgr = StructuredOutputManager(tok, vocab, [tok.eos_token_id], torch.device("cpu"))
    seq = SimpleNamespace(finished=False, params=SimpleNamespace(bad_words_token_ids=None, structured_outputs=SO(
        json=SCHEMA)), draft_token_ids=[], output_token_ids=[])
    group = SimpleNamespace(seqs=[seq], request_id="r")
    if mgr.hold(group):  # compiling on the compiler's worker
        mgr.compiler.submit(seq.params.structured_outputs).result()
        assert mgr.ready(True)[0][1] is None
    g = seq.grammar
    assert g.ws is mgr.compiler.ws_tables
    space = tok.encode(" ", add_special_tokens=False)
    assert len(space) == 1
    for t in tok.encode('{"name":', add_special_tokens=False):
        g.push(t)
    ws_tokens = [t for t in range(vocab) if not _allowed(g.ws.keep, t)]
    for n in range(MAX_RUN + 2):
        row = mgr.bitmask([seq], [0]).bitmask[0].numpy()
        allowed_ws = [t for t in ws_tokens if _allowed(row, t)]
        assert bool(allowed_ws) == (n < MAX_RUN), n  # the grammar's whitespace is unbounded: the ban ends it
        assert _allowed(row, tok.encode('"', add_special_tokens=False)[0])
        g.push(space[0])
    assert g.matcher.accept_string(" " * 20)  # no bound in the grammar itself
    mgr.close()


def test_engine_outputs_validate(monkeypatch):
    """Sampled (temperature 1.5, so whitespace runs come up) outputs of 6 requests on the async loop."""
    monkeypatch.setenv("LAMINA_JSON_WHITESPACE_ON_HOST", "1")
    from lamina.config import EngineConfig
    from lamina.engine.engine import LLMEngine
    from lamina.llm import chat_prompt_ids
    from lamina.models.loader import DEFAULT_MODEL

    eng = LLMEngine(EngineConfig(model=DEFAULT_MODEL, dtype="float32", device="cpu", dequantize_gguf=True,
                                 async_scheduling=True), progress=False)
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=48, structured_outputs=SO(json=SCHEMA))
    for i in range(6):
        msg = [{"role": "user", "content": f"Invent person {i} with a name and an age, as JSON."}]
        eng.add_request(str(i), chat_prompt_ids(eng.tokenizer, msg), params)
    seqs = [eng.groups[str(i)].seqs[0] for i in range(6)]
    assert seqs[0].grammar is None or seqs[0].grammar.ws is not None
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        assert steps < 500
    assert all(s.grammar.ws is not None for s in seqs)
    done = [s for s in seqs if s.finish_reason == "stop"]
    assert len(done) >= 3
    for s in done:
        jsonschema.validate(json.loads(eng.tokenizer.decode(s.output_token_ids, skip_special_tokens=True)), SCHEMA)
