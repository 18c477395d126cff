"""Host-side pieces of structured output and the logits controls, against their oracles: the bitmask
against xgrammar's own apply_token_bitmask_inplace, the sampler's controls against a torch reference,
draft rows against a matcher advanced by hand, the compile cache and the error messages."""
from __future__ import annotations

import json

import pytest
import torch

from lamina.engine.detokenizer import initial_state
from lamina.engine.request import Sequence
from lamina.engine.sampler import Sampler
from lamina.sampling_params import SamplingParams
from lamina.structured.bitmask import (
    BitmaskBuffers,
    apply_bitmask,
    apply_bitmask_tensor_ops,
    bitmask_width,
    masked_copy,
)
from lamina.structured.manager import _ban_bad_words
from lamina.structured.params import StructuredOutputsError
from lamina.structured.params import StructuredOutputsParams as SO


@pytest.mark.parametrize("apply", [apply_bitmask, apply_bitmask_tensor_ops])
@pytest.mark.parametrize("vocab", [31, 32, 100, 1000])
def test_apply_bitmask_matches_xgrammar(vocab, apply):
    xg = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    bits = torch.randint(-(2**31), 2**31 - 1, (5, bitmask_width(vocab)), generator=g, dtype=torch.int64)
    mask = bits.to(torch.int32)
    mask[0] = -1  # all allowed
    ref = logits.clone()
    xg.apply_token_bitmask_inplace(ref, mask)
    got = logits.clone()
    apply(got, mask)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # float64: the tensor-ops path on the CPU
def test_apply_bitmask_to_some_rows_leaves_the_others(dtype):
    xg = pytest.importorskip("xgrammar")
    vocab = 1000
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, vocab, generator=g, dtype=dtype)
    mask = torch.randint(-(2**31), 2**31 - 1, (2, bitmask_width(vocab)), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([4, 1])
    ref = logits.clone().float()
    sub = ref[[4, 1]].clone()
    xg.apply_token_bitmask_inplace(sub, mask)
    ref[[4, 1]] = sub
    got = logits.clone()
    apply_bitmask(got, mask, rows)
    assert torch.equal(got.float(), ref)


@pytest.mark.parametrize("subset", [False, True])
def test_sparse_cpu_apply_matches_xgrammar_on_each_kind_of_row(subset):
    """Rows mostly allowed, mostly banned (a few words set, one past the vocabulary's end), all of either,
    and random words; every row or a subset in another order."""
    xg = pytest.importorskip("xgrammar")
    from lamina.structured.bitmask import apply_bitmask_sparse

    vocab, n = 1000, 8
    width = bitmask_width(vocab)
    g = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)
    mask = rand(n, width)
    mask[0] = -1
    mask[1] = 0
    mask[2] = 0
    mask[2, [3, 17, width - 1]] = rand(3)
    mask[3] = -1
    mask[3, [0, 5]] = rand(2)
    mask[4] = 0
    mask[4, width - 1] = -1  # bits past the vocabulary
    logits = torch.randn(12 if subset else n, vocab, generator=g)
    logits[0, :5] = float("-inf")
    rows = torch.tensor([11, 0, 5, 2, 9, 3, 1, 7]) if subset else None
    want = logits.clone()
    if subset:
        part = want[rows].clone()
        xg.apply_token_bitmask_inplace(part, mask, vocab_size=vocab)
        want[rows] = part
    else:
        xg.apply_token_bitmask_inplace(want, mask, vocab_size=vocab)
    got = logits.clone()
    apply_bitmask_sparse(got, mask, rows)
    assert torch.equal(got, want)
    copied = masked_copy(logits, mask, rows)  # the out-of-place form: the same, and logits untouched
    assert torch.equal(copied, want) and not torch.equal(logits, want)


def test_masked_copy_equals_clone_and_apply():
    """The device path when the mask is the sampler's only edit: one out-of-place pass, same values."""
    vocab = 300
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, vocab, generator=g)
    mask = torch.randint(-(2**31), 2**31 - 1, (4, bitmask_width(vocab)), generator=g, dtype=torch.int64).to(torch.int32)
    want = logits.clone()
    apply_bitmask(want, mask)
    got = masked_copy(logits, mask)
    assert torch.equal(got, want) and got.data_ptr() != logits.data_ptr()
    on_device = masked_copy(logits.double(), mask)  # float64: the device path's tensor ops, on the CPU
    assert torch.equal(on_device.float(), want)
    rows = torch.tensor([3, 0])
    part = logits.double().clone()
    apply_bitmask(part, mask[:2], rows)
    assert torch.equal(masked_copy(logits.double(), mask[:2], rows), part)


def test_bitmask_buffers_alternate_and_reset():
    bufs = BitmaskBuffers(100, torch.device("cpu"))
    a = bufs.host(3)
    a.zero_()
    b = bufs.host(2)
    assert a.data_ptr() != b.data_ptr() and b.shape == (2, 4) and bool((b == -1).all())
    c = bufs.host(3)
    assert c.data_ptr() == a.data_ptr() and bool((c == -1).all())


def test_ban_bad_words_clears_exactly_the_last_token():
    host = torch.full((2, 2), -1, dtype=torch.int32)
    _ban_bad_words(host, 0, [5, 7, 8], [[7, 8, 31], [9, 40]])  # output ends with 7, 8: ban 31
    _ban_bad_words(host, 1, [5, 9], [[7, 8, 31], [9, 40]])  # ends with 9: ban 40
    allowed = ((host[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(2, -1).bool()
    assert (~allowed[0]).nonzero().flatten().tolist() == [31]
    assert (~allowed[1]).nonzero().flatten().tolist() == [40]


def _seq(i: int, params: SamplingParams, out: list[int] | None = None) -> Sequence:
    toks = [1, 2, 3] + (out or [])
    return Sequence(i, str(i), 0, toks, 3, params, params.seed, 16, initial_state(3))


def test_sampler_controls_match_a_torch_reference():
    vocab = 64
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g)
    params = [SamplingParams(temperature=0, logit_bias={3: 100.0, 5: -100.0}),
              SamplingParams(temperature=0, allowed_token_ids=[7, 9, 11]),
              SamplingParams(temperature=0, bad_words_token_ids=[[int(logits[2].argmax())]]),
              SamplingParams(temperature=0.8, seed=1, allowed_token_ids=[2], logit_bias={2: -50.0})]
    seqs = [_seq(i, p) for i, p in enumerate(params)]
    out = Sampler([0]).sample(logits.clone(), seqs).token_ids.tolist()
    ref = logits.clone()
    ref[0, 3] += 100.0
    ref[0, 5] -= 100.0
    keep = torch.full((vocab,), float("-inf"))
    keep[[7, 9, 11]] = 0
    ref[1] += keep
    ref[2, int(logits[2].argmax())] = float("-inf")
    assert out[:3] == ref[:3].argmax(dim=-1).tolist()
    assert out[3] == 2  # the only allowed token, whatever its bias


def test_sampler_bitmask_rows_and_logprobs_of_the_raw_distribution():
    vocab = 70
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    mask = torch.full((3, bitmask_width(vocab)), -1, dtype=torch.int32)
    mask[1] = 0
    mask[1, 2] = 1 << 3  # row 1: only token 67
    seqs = [_seq(i, SamplingParams(temperature=0.7 if i else 0, seed=i, logprobs=0)) for i in range(3)]
    draws = Sampler([0]).sample(logits.clone(), seqs, bitmask=mask)
    toks = draws.token_ids.tolist()
    assert toks[1] == 67 and toks[0] == int(logits[0].argmax())
    raw_lp = logits.log_softmax(-1)
    assert torch.allclose(draws.chosen_logprobs, raw_lp[torch.arange(3), draws.token_ids])


def test_grammar_rows_after_drafts_match_a_matcher_advanced_by_hand():
    xg = pytest.importorskip("xgrammar")
    from lamina.structured.compiler import GrammarCompilerService
    from lamina.structured.state import GrammarState

    tok = _tokenizer()
    svc = GrammarCompilerService(tok, len(tok), [tok.eos_token_id])
    compiled = svc.compile(SO(choice=["alpha beta", "alpine"]))
    state = GrammarState(compiled)
    drafts = tok("alpha beta", add_special_tokens=False).input_ids
    got = torch.full((len(drafts) + 1, bitmask_width(len(tok))), -1, dtype=torch.int32)
    state.fill(got, 0, drafts, len(drafts) + 1)
    ref = torch.full_like(got, -1)
    m = xg.GrammarMatcher(compiled)
    for j in range(len(drafts) + 1):
        m.fill_next_token_bitmask(ref, j)
        if j < len(drafts):
            assert m.accept_token(drafts[j])
    assert torch.equal(got, ref)
    assert state.num_accepted == 0 and not state.terminated  # fill() leaves the state where it was
    for t in drafts:
        assert state.accept(t)
    assert not state.accept(drafts[0]) and state.broken  # rejected: unconstrained from now on


def _tokenizer():
    from lamina.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_source

    return load_tokenizer(resolve_source(DEFAULT_MODEL))


def test_compile_cache_and_reasons():
    pytest.importorskip("xgrammar")
    from lamina.structured.compiler import GrammarCompilerService

    tok = _tokenizer()
    svc = GrammarCompilerService(tok, len(tok))
    a = svc.submit(SO(json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    b = svc.submit(SO(json=json.dumps({"properties": {"a": {"type": "integer"}}, "type": "object"})))
    assert b is not a  # text schemas are keyed by their text
    c = svc.submit(SO(json={"properties": {"a": {"type": "integer"}}, "type": "object"}))
    assert c is a  # the same schema object (any key order): one compilation
    for spec, reason in ((SO(json={"type": "objekt"}), 'invalid JSON schema: Unsupported type "objekt"'),
                         (SO(regex="(ab"), "invalid regex: Regex parsing error at position 4"),
                         (SO(grammar="root ::= x"), "invalid grammar: EBNF parser error at line 1, column 10")):
        with pytest.raises(StructuredOutputsError) as e:
            svc.check(spec)
        assert str(e.value).startswith(reason) and "/project/" not in str(e.value)
    svc.close()


def test_params_round_trip_and_validation():
    import dataclasses

    p = SamplingParams(structured_outputs={"choice": ["a", "b"]}, logit_bias={"7": 1.5}, bad_words=["x"])
    again = SamplingParams(**dataclasses.asdict(p))  # how the params cross to the core process
    assert again.structured_outputs == p.structured_outputs and again.logit_bias == {7: 1.5}
    with pytest.raises(ValueError, match="token id 50, .* has 50 tokens"):
        SamplingParams(logit_bias={50: 1.0}).validate(50)
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={5: 100.5})
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(StructuredOutputsError, match="unknown structured_outputs fields: jsonn"):
        SamplingParams(structured_outputs={"jsonn": {}})


def test_bench_json_schema_flag(tmp_path):
    from lamina.bench.serve import request_extras

    f = tmp_path / "s.json"
    f.write_text('{"type": "object"}')
    assert request_extras('{"top_k": 5}', str(f)) == {"top_k": 5, "structured_outputs": {"json": {"type": "object"}}}
    assert request_extras("{}", None) == {}


def test_manager_bitmask_batch_fill_equals_one_matcher_at_a_time():
    """The step's mask (single-row grammars filled together over threads, a verify run row by row, a
    terminated grammar and an unconstrained row left all ones) equals each matcher filled on its own."""
    xg = pytest.importorskip("xgrammar")
    from types import SimpleNamespace

    from lamina.structured.manager import StructuredOutputManager
    from lamina.structured.state import GrammarState

    tok = _tokenizer()
    mgr = StructuredOutputManager(tok, len(tok), [tok.eos_token_id], torch.device("cpu"))
    compiled = mgr.compiler.compile(SO(json={"type": "object", "properties": {"a": {"type": "string"}},
                                             "required": ["a"]}))
    texts = ['{"a": "x', '{"a', "", '{"a": "yz"}']
    seqs = []
    for text in texts:
        st = GrammarState(compiled)
        for t in tok(text, add_special_tokens=False).input_ids:
            assert st.accept(t)
        seqs.append(SimpleNamespace(grammar=st, finished=False, draft_token_ids=[], params=SamplingParams(),
                                    output_token_ids=[]))
    seqs.append(SimpleNamespace(grammar=None, finished=False, draft_token_ids=[], params=SamplingParams(),
                                output_token_ids=[]))
    verify = seqs[1]
    verify.draft_token_ids = tok('": "', add_special_tokens=False).input_ids[:2]
    rows = [seqs[0], verify, verify, verify, seqs[2], seqs[3], seqs[4]]
    offsets = [0, 0, 1, 2, 0, 0, 0]
    step = mgr.bitmask(rows, offsets)
    got = step.bitmask.clone()
    want = torch.full((len(rows), got.shape[1]), -1, dtype=torch.int32)
    seqs[0].grammar.matcher.fill_next_token_bitmask(want, 0)
    verify.grammar.fill(want, 1, verify.draft_token_ids, 3)
    seqs[2].grammar.matcher.fill_next_token_bitmask(want, 4)
    seqs[3].grammar.matcher.fill_next_token_bitmask(want, 5)
    assert step.host_rows == [0, 1, 2, 3, 4, 5] and step.rows.tolist() == step.host_rows  # not row 6
    assert torch.equal(got, want[step.host_rows])
    assert not torch.equal(got[0], got[4])  # different states, different masks
    done = GrammarState(compiled)
    assert all(done.accept(t) for t in tok('{"a": "q"}', add_special_tokens=False).input_ids + [tok.eos_token_id])
    assert done.terminated
    ended = SimpleNamespace(grammar=done, finished=False, draft_token_ids=[], params=SamplingParams(),
                            output_token_ids=[])
    assert mgr.bitmask([ended, seqs[4]], [0, 0]) is None  # a terminated grammar, no grammar: no mask at all
    every = mgr.bitmask([seqs[0], seqs[2]], [0, 0])
    assert every.rows is None and torch.equal(every.bitmask, want[[0, 4]])
    del xg


@pytest.mark.parametrize("case", ["mask only", "with penalties", "with logprobs", "every row"])
def test_sampler_masked_rows_draw_what_a_full_mask_draws(case):
    """The step mask of some rows (bitmask_rows) draws exactly what the old full-row mask (all ones where
    unconstrained, applied by the plain tensor ops) draws, on every sampler path."""
    vocab, n = 5000, 6
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(n, vocab, generator=g)
    rand = lambda *shape: torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)
    full = torch.full((n, bitmask_width(vocab)), -1, dtype=torch.int32)
    masked = list(range(n)) if case == "every row" else [4, 1, 2]
    full[masked[0]] = 0
    full[masked[0], [3, 40, 99]] = rand(3)  # mostly banned
    full[masked[1]] = rand(bitmask_width(vocab))  # mixed words
    full[masked[2], [0, 7]] = 0  # mostly allowed
    extra = dict(repetition_penalty=1.3, frequency_penalty=0.5) if case == "with penalties" else {}
    lp = dict(logprobs=2) if case == "with logprobs" else {}
    seqs = [_seq(i, SamplingParams(temperature=0 if i % 3 == 0 else 0.7, seed=i, **extra, **lp), out=[5, 6])
            for i in range(n)]
    ref_logits = logits.clone()
    apply_bitmask_tensor_ops(ref_logits, full)
    want = Sampler([0]).sample(ref_logits, seqs)
    rows = None if case == "every row" else torch.tensor(masked)
    got = Sampler([0]).sample(logits.clone(), seqs, bitmask=full[masked].contiguous(), bitmask_rows=rows)
    assert torch.equal(got.token_ids, want.token_ids)
    if case == "with logprobs":  # of the raw distribution, not the masked one
        raw = logits.log_softmax(-1)
        assert torch.allclose(got.chosen_logprobs, raw[torch.arange(n), got.token_ids])
