"""The step loop's data model: multi-token steps (draft verification through prepare and in-flight
resolution), persistent block-table rows, the one staged copy, vectorized sampling against per-row
oracles, and a failing step retried without the request that caused it."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lamina import LLM, SamplingParams
from lamina.engine.block_tables import BlockTables
from lamina.engine.detokenizer import initial_state
from lamina.engine.inflight import PENDING
from lamina.engine.request import SeqStatus, Sequence
from lamina.engine.sampler import Sampler, _penalize
from lamina.engine.sampling_metadata import build_arrays, to_device
from lamina.engine.staging import StepStaging

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "progress": False, **kw}
    return LLM(model=str(path), **kw)


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 30))]} for _ in range(n)]


def all_free(llm: LLM) -> bool:
    eng = llm.engine
    return eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running and not eng.groups


@pytest.fixture(scope="module")
def reference(checkpoints):
    llm = make(checkpoints["llama"], num_kv_blocks=256)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(4), GREEDY, use_tqdm=False)]


def test_prepare_lays_out_a_verify_step(checkpoints):
    llm = make(checkpoints["llama"], num_kv_blocks=64, async_scheduling=False)
    eng = llm.engine
    eng.add_request("r", prompts(1)[0], GREEDY)
    eng.step()  # the prompt, and its first token
    seq = eng.groups["r"].seqs[0]
    n = seq.num_tokens
    seq.draft_token_ids = [11, 12]
    item, = eng.scheduler.schedule().scheduled
    assert (item.num_tokens, item.num_sampled) == (3, 3)
    batch = eng.runner.prepare([item], None)
    assert batch.input_ids.tolist() == [seq.token_ids[-1], 11, 12]
    assert batch.positions.tolist() == [n - 1, n, n + 1]
    table = seq.block_table
    assert batch.attn.slot_mapping.tolist() == [table[p // 4] * 4 + p % 4 for p in (n - 1, n, n + 1)]
    assert batch.attn.seq_lens.tolist() == [n + 2] and batch.attn.query_start.tolist() == [0, 3]
    assert batch.logits_indices.tolist() == [0, 1, 2] and batch.sample_rows is None
    assert batch.sampled == [seq] * 3 and batch.offsets == [0, 1, 2]
    assert batch.attn.block_tables[0, :len(table)].tolist() == table


def test_sampling_arrays_ship_after_the_forward_equal_the_samplers_own(checkpoints):
    """prepare() ships the forward's inputs only; ship_sampling (called once the forward is launched, so its
    host work overlaps the device) gives a verify step's rows the metadata sample() would build itself: seeds
    and min_tokens per output index, penalties over the history with the drafts before each row."""
    llm = make(checkpoints["llama"], num_kv_blocks=64, async_scheduling=False)
    eng = llm.engine
    params = SamplingParams(temperature=0.7, top_k=20, seed=5, min_tokens=3, repetition_penalty=1.2,
                            presence_penalty=0.3, max_tokens=20, ignore_eos=True, stop_token_ids=[7])
    eng.add_request("r", prompts(1)[0], params)
    eng.step()
    seq = eng.groups["r"].seqs[0]
    seq.draft_token_ids = [11, 12, 11]
    item, = eng.scheduler.schedule().scheduled
    batch = eng.runner.prepare([item], None)
    assert batch.sampling is None
    eng.runner.ship_sampling(batch, eng.sampler)
    want = to_device(build_arrays(batch.sampled, batch.offsets, eng.sampler.eos, eng.runner.vocab),
                     batch.sampled, torch.device("cpu"))
    got = batch.sampling
    assert got.num_rows == want.num_rows == 4 and got.any_seeded and not got.all_greedy
    for name in ("temperature", "keys", "pen_row", "pen_token", "pen_out_count", "ban_row", "ban_token", "top_k"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.ban_row.tolist() == [0, 1] and got.ban_token.tolist() == [7, 7]  # output indices 1, 2 < min_tokens 3


@pytest.mark.parametrize("overlap", [False, True])
def test_drafts_verified_with_greedy_acceptance(checkpoints, reference, overlap):
    """A fake proposer offers the reference continuation with every third guess wrong: the outputs are the
    reference exactly, in fewer steps than one token per step, and every block is returned. With overlap the
    drafts follow a token still in flight (the runner takes it from the device; the verify step syncs)."""
    llm = make(checkpoints["llama"], num_kv_blocks=256, async_scheduling=overlap)
    eng = llm.engine
    ps = prompts(4)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, GREEDY)
    seqs = [eng.groups[str(i)].seqs[0] for i in range(4)]
    steps, proposals = 0, 0
    while eng.has_unfinished_requests():
        for i, seq in enumerate(seqs):
            if seq.finished or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            out = seq.num_output_tokens
            guess = list(reference[i][out:out + 3])
            if steps % 3 == 0 and guess:
                guess[-1] = (guess[-1] + 1) % 1000  # a wrong draft: rejected, the model's token kept instead
            seq.draft_token_ids = guess
            proposals += bool(guess)
        eng.step()
        steps += 1
        assert steps < 200
        assert all(t != PENDING for s in seqs for t in s.token_ids[:-1])
    assert [s.output_token_ids for s in seqs] == reference
    assert proposals and steps < len(reference[0]) + 2
    assert all_free(llm)


def _seq(i: int, table: list[int]) -> Sequence:
    s = Sequence(i, str(i), 0, [1, 2, 3], 3, GREEDY, None, 8, initial_state(3), status=SeqStatus.RUNNING)
    s.block_table = table
    return s


def test_block_tables_send_only_changed_entries():
    bt = BlockTables(torch.device("cpu"))
    a, b = _seq(0, [5, 6]), _seq(1, [7])
    rows, flat, vals = bt.update([a, b])
    bt.apply(torch.from_numpy(flat), torch.from_numpy(vals))
    assert sorted(vals.tolist()) == [5, 6, 7]
    rows2, flat, vals = bt.update([b, a])
    assert flat.size == 0 and rows2.tolist() == rows[::-1].tolist()  # nothing changed: nothing travels
    a.block_table.append(9)  # grew in place: only the new block
    _, flat, vals = bt.update([a])
    bt.apply(torch.from_numpy(flat), torch.from_numpy(vals))
    assert vals.tolist() == [9]
    b.block_table = [3, 4]  # replaced (preemption, prefix match): the whole table again
    rows3, flat, vals = bt.update([a, b])
    bt.apply(torch.from_numpy(flat), torch.from_numpy(vals))
    assert vals.tolist() == [3, 4]
    got = bt.gather(torch.from_numpy(rows3), 3)
    assert got[0].tolist() == [5, 6, 9] and got[1, :2].tolist() == [3, 4]
    a.status = SeqStatus.FINISHED  # its row is reclaimed once a new sequence needs one
    c = _seq(2, [8])
    for i in range(3, 3 + len(bt._owner) - 2):
        bt.update([_seq(i, [i])])
    rows4, _, _ = bt.update([c])
    assert rows4[0] == rows3[0]


def test_staging_ships_typed_arrays_in_one_copy():
    st = StepStaging(torch.device("cpu"))
    arrays = [np.arange(5, dtype=np.int64), np.array([True, False]), np.zeros(0, np.int64),
              np.array([1.5, -2.0], np.float32), np.array([7, 8, 9], np.int32)]
    for a in arrays:
        st.add(a)
    views = st.ship()
    for a, v in zip(arrays, views):
        assert v.numpy().dtype == a.dtype and v.tolist() == a.tolist()
        # Every view starts 16-byte aligned relative to the buffer: Triton specializes kernels on pointer
        # alignment, and a view whose alignment changed from step to step would recompile them.
        assert (v.data_ptr() - views[0].data_ptr()) % 16 == 0


def _oracle_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The per-row loop the vectorized penalties replace."""
    out = logits.clone()
    for row, s in enumerate(seqs):
        p = s.params
        ids = torch.tensor(sorted(set(s.token_ids)))
        vals = out[row, ids]
        out[row, ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        counts = torch.zeros(out.shape[1])
        for t in s.output_token_ids:
            counts[t] += 1
        out[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


def test_vectorized_penalties_match_per_row_loop():
    rng = random.Random(0)
    seqs = []
    for i in range(6):
        p = SamplingParams(temperature=0.7, repetition_penalty=rng.choice([1.0, 1.3]),
                           presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=rng.choice([0.0, -0.4]))
        toks = [rng.randrange(40) for _ in range(rng.randrange(2, 30))]
        seqs.append(Sequence(i, "r", 0, toks, rng.randrange(1, len(toks)), p, None, 16, initial_state(1)))
    logits = torch.randn(6, 40)
    m = to_device(build_arrays(seqs, None, [], 40), seqs, torch.device("cpu"))
    got = logits.clone()
    _penalize(got, m)
    assert torch.allclose(got, _oracle_penalties(logits, seqs), atol=1e-6)


def test_top_k_candidates_draw_what_the_sorted_vocabulary_draws():
    """Seeded rows: the top-k candidate path and the full sort see the same noise, so the same tokens. (With
    top-p too the nucleus boundary is computed from differently ordered sums, so a token sitting exactly on it
    may differ in the last bit: not compared here.)"""
    sampler = Sampler([], seed=0)
    logits = torch.randn(8, 500)
    settings = [(5, 0.0), (20, 0.1), (1, 0.0), (50, 0.0)] * 2
    seqs = [Sequence(i, "r", 0, [1, 2] + [3] * i, 2, SamplingParams(temperature=0.9, top_k=k, min_p=mp, seed=5),
                     5, 16, initial_state(2)) for i, (k, mp) in enumerate(settings)]
    meta = to_device(build_arrays(seqs, None, [], 500), seqs, torch.device("cpu"))
    assert meta.candidates == 50
    fast = sampler.sample(logits, seqs, meta).token_ids.tolist()
    meta.candidates = 0
    assert sampler.sample(logits, seqs, meta).token_ids.tolist() == fast


def test_out_of_range_parameters_do_not_fail_the_sampler():
    # SamplingParams refuses these at the edge; the sampler still must not fail a step should one get through.
    params = SamplingParams(temperature=1.0, min_tokens=2)
    params.top_k, params.stop_token_ids = 2**63, [10**9]
    seqs = [Sequence(0, "r", 0, [1, 2], 2, params, None, 16, initial_state(2))]
    assert Sampler([10**9])(torch.randn(1, 50), seqs).token_ids[0] in range(50)


def test_failed_step_is_retried_without_its_culprit(checkpoints, reference, monkeypatch):
    llm = make(checkpoints["llama"], num_kv_blocks=256)
    eng = llm.engine
    real = eng.sampler.sample

    def sample(logits, seqs, *a, **kw):
        if any(s.request_id == "bad" for s in seqs):
            raise RuntimeError("injected sampler fault")
        return real(logits, seqs, *a, **kw)

    monkeypatch.setattr(eng.sampler, "sample", sample)
    ps = prompts(4)
    for i, p in enumerate(ps[:2]):
        eng.add_request(str(i), p, GREEDY)
    eng.add_request("bad", ps[2], GREEDY)
    for i, p in enumerate(ps[2:], start=2):
        eng.add_request(str(i), p, GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert "injected sampler fault" in done["bad"].error
    assert [done[str(i)].outputs[0].token_ids for i in range(4)] == reference
    assert all(done[str(i)].error is None for i in range(4))
    assert eng.stats().num_step_failures >= 1
    assert all_free(llm)


def test_step_failures_reach_the_metric():
    from lamina.engine.async_engine import IterationStats
    from lamina.engine.engine import EngineStats
    from lamina.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.on_iteration(IterationStats(), EngineStats(0, 0, 1, 1, num_step_failures=2))
    metrics.on_iteration(IterationStats(), EngineStats(0, 0, 1, 1, num_step_failures=3))
    assert b'lamina:engine_step_failures_total{model_name="m"} 3.0' in metrics.render()[0]


def test_penalized_rows_overlap_without_a_sync(checkpoints, monkeypatch):
    """Penalties read a history token still in flight from the device: read back one step late (no sync
    forced), the outputs equal those of the synchronous engine, for every penalty and min_tokens."""
    from lamina.engine import sampler as sampler_mod

    params = [SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.8),
              SamplingParams(temperature=0, max_tokens=16, presence_penalty=1.5, frequency_penalty=0.7),
              SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, frequency_penalty=-0.5),
              SamplingParams(temperature=0.8, seed=3, max_tokens=16, min_tokens=10, presence_penalty=0.6)]
    late_calls = []
    real_late = sampler_mod._penalize_late
    monkeypatch.setattr(sampler_mod, "_penalize_late", lambda lg, m: late_calls.append(1) or real_late(lg, m))
    outs = {}
    for overlap in (False, True):
        llm = make(checkpoints["llama"], num_kv_blocks=256, async_scheduling=overlap)
        eng, synced = llm.engine, []
        real_commit = eng._commit
        monkeypatch.setattr(eng, "_commit", lambda *a, _log=synced, _commit=real_commit:
                            _log.append(_commit(*a)) or _log[-1])
        res = llm.generate(prompts(4, seed=1), params, use_tqdm=False)
        outs[overlap] = [o.outputs[0].token_ids for o in res]
        assert all_free(llm)
        if overlap:
            assert not any(f.sync for f in synced) and late_calls  # left in flight; late tokens penalized
    assert outs[True] == outs[False]
