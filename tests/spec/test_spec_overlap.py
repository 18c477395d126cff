"""Speculation that costs nothing when it does not pay: a step where no sequence may draft next overlaps with
the device like a non-speculative step (not read back before the next one is built); low acceptance across
the batch turns speculation off batch-wide (probed again, reported in EngineStats and Prometheus); a drafter
that never finds anything counts as rejected; disable_by_batch_size stops drafting above a batch size."""
from __future__ import annotations

import pytest
from spec_helpers import GREEDY64, OracleProposer, all_free, make, outputs, spec_prompts

from lamina.engine.engine import EngineStats
from lamina.spec.adaptive import BatchGate, GateSettings
from lamina.spec.config import parse_speculative_config
from lamina.spec.decoder import SpecDecoder


@pytest.fixture(scope="module")
def plain(checkpoints, one_thread):
    ps = spec_prompts(4, seed=43)
    return ps, outputs(make(checkpoints["llama"]), ps, GREEDY64)


def _with(llm, proposer, **opts):
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "gate": "acceptance",
                                    **opts})
    llm.engine.spec = SpecDecoder(cfg, proposer)
    return llm


def _count_syncs(llm) -> dict:
    """Counts launched steps by kind: verify, read back at once (sync), overlapped."""
    eng, seen = llm.engine, {"verify": 0, "sync": 0, "overlapped": 0}
    commit = eng._commit

    def counted(scheduled, draws):
        flight = commit(scheduled, draws)
        if any(n > 1 for _, _, n in flight.sampled):
            seen["verify"] += 1
        seen["sync" if flight.sync else "overlapped"] += 1
        return flight
    eng._commit = counted
    return seen


class Nothing:
    """A drafter that never finds a draft (n-gram lookup on text that never repeats)."""

    def propose(self, seqs, k):
        return [[] for _ in seqs]


def test_wrong_drafts_overlap_once_paused(checkpoints, plain):
    ps, ref = plain
    llm = _with(make(checkpoints["llama"], async_scheduling=True), OracleProposer(ps, ref, wrong=True))
    seen = _count_syncs(llm)
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    assert st.num_spec_batch_pauses >= 1 and st.num_spec_accepted_tokens == 0
    # a few verify steps, then plain decode steps overlapped as without speculation
    assert seen["verify"] <= 6 and seen["overlapped"] >= 50
    assert all_free(llm)


def test_right_drafts_keep_speculating(checkpoints, plain):
    ps, ref = plain
    llm = _with(make(checkpoints["llama"], async_scheduling=True), OracleProposer(ps, ref))
    seen = _count_syncs(llm)
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    assert st.num_spec_batch_pauses == 0 and st.num_spec_accepted_tokens > 40 * len(ps)
    assert seen["verify"] >= 15
    assert all_free(llm)


def test_drafter_that_never_matches_turns_off(checkpoints, plain):
    ps, ref = plain
    llm = _with(make(checkpoints["llama"], async_scheduling=True), Nothing())
    seen = _count_syncs(llm)
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    # each sequence pauses itself (the batch gate judges verified drafts only: there are none)
    assert st.num_spec_drafts == 0 and st.num_spec_pauses == len(ps) and st.num_spec_batch_pauses == 0
    # max_empty (16) empty proposals in a row read back at once, then overlapped steps
    assert seen["verify"] == 0 and seen["sync"] <= 20 and seen["overlapped"] >= 40
    assert all_free(llm)


def test_disable_by_batch_size(checkpoints, plain):
    ps, ref = plain
    over = _with(make(checkpoints["llama"]), OracleProposer(ps, ref), disable_by_batch_size=len(ps) - 1)
    assert outputs(over, ps, GREEDY64) == ref
    st = over.engine.stats()
    assert st.num_spec_drafts == 0 and st.num_spec_batch_size_skips >= 60
    at = _with(make(checkpoints["llama"]), OracleProposer(ps, ref), disable_by_batch_size=len(ps))
    assert outputs(at, ps, GREEDY64) == ref
    assert at.engine.stats().num_spec_accepted_tokens > 0 and at.engine.stats().num_spec_batch_size_skips == 0
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0})
    cfg = parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 32})
    assert cfg.disable_by_batch_size == 32 and parse_speculative_config(cfg.to_dict()) == cfg


def test_batch_gate_backoff():
    gate = BatchGate(GateSettings(min_acceptance_rate=0.5, probe_interval=3, min_verifies=2, alpha=0.5),
                     max_backoff=4)
    assert gate.tick() and not gate.paused
    gate.record(10, 0)
    assert not gate.paused  # one step is not enough to judge
    gate.record(10, 0)
    assert gate.paused and gate.num_pauses == 1 and gate.off_for == 3
    assert [gate.tick() for _ in range(3)] == [False, False, True]  # the probe
    assert gate.num_probes == 1 and not gate.paused
    gate.record(10, 1)
    gate.record(10, 0)
    assert gate.off_for == 6  # a failed probe doubles the interval
    for _ in range(6):
        gate.tick()
    gate.record(10, 0)
    gate.record(10, 0)
    assert gate.off_for == 12  # capped at max_backoff x probe_interval from here
    for _ in range(12):
        gate.tick()
    gate.record(10, 9)
    gate.record(10, 9)
    assert not gate.paused and gate.backoff == 1  # acceptance came back: the next pause starts afresh
    assert not BatchGate(GateSettings(min_acceptance_rate=0)).enabled


def test_batch_pause_metrics():
    pytest.importorskip("prometheus_client")
    from lamina.engine.ipc import Codec, IterationStats, StepOutputs
    from lamina.server.metrics import ServerMetrics

    m, codec = ServerMetrics("x"), Codec()
    for paused, pauses in ((True, 1), (False, 3)):
        stats = EngineStats(1, 0, 10, 10, spec_batch_paused=paused, num_spec_batch_pauses=pauses)
        msg = codec.from_core.decode(codec.encode(StepOutputs(1, [], IterationStats(), stats)))
        assert msg.stats == stats
        m.on_iteration(IterationStats(), msg.stats)
    sample = {s.name + str(sorted(s.labels.items())): s.value for fam in m.registry.collect() for s in fam.samples}
    assert sample["lamina:spec_decode_num_batch_pauses_total[('model_name', 'x')]"] == 3
    assert sample["lamina:spec_decode_batch_paused[('model_name', 'x')]"] == 0
