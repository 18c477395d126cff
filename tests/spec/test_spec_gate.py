"""Speculation turns itself off per sequence when its acceptance stays low, and back on after a probe interval
(spec/adaptive.py): a forced-wrong proposer stops being asked (output unchanged, far fewer verify steps),
one that turns right later gets speculation back on probing; the pauses show in EngineStats, Prometheus
and the log; the options are checked."""
from __future__ import annotations

import logging

import msgspec
import pytest
from spec_helpers import GREEDY64, OracleProposer, all_free, make, outputs, spec_prompts
from test_spec_goodput import FakeClock

from lamina.engine.engine import EngineStats
from lamina.engine.ipc import Codec, IterationStats, StepOutputs
from lamina.spec.adaptive import AcceptanceGate, GateSettings
from lamina.spec.config import parse_speculative_config
from lamina.spec.decoder import SpecDecoder


@pytest.fixture(scope="module")
def plain(checkpoints, one_thread):
    ps = spec_prompts(4, seed=41)
    return ps, outputs(make(checkpoints["llama"]), ps, GREEDY64)


def _with(llm, proposer, **gate):
    """The per-sequence gate alone: the goodput gate's clock makes a verify step cost half a plain one, so
    drafting always pays batch-wide (the batch gate of "acceptance" pauses every sequence first)."""
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, **gate})
    clock = FakeClock(lambda rows, verify: 0.5e-3 if verify else 1e-3)
    llm.engine.spec = SpecDecoder(cfg, proposer, clock=clock)
    clock.install(llm)
    return llm


def test_wrong_drafts_pause_speculation(checkpoints, plain, caplog):
    ps, ref = plain
    off = _with(make(checkpoints["llama"]), OracleProposer(ps, ref, wrong=True), min_acceptance_rate=0)
    assert outputs(off, ps, GREEDY64) == ref
    ungated = off.engine.stats().num_spec_drafts
    assert ungated >= 60 * len(ps)  # every decode step verified wrong drafts
    llm = _with(make(checkpoints["llama"]), OracleProposer(ps, ref, wrong=True))
    with caplog.at_level(logging.INFO, logger="lamina"):
        assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    # 7 verify steps each (AcceptanceGate's prior of K/2 accepted: 4, min_verifies, were too few to tell a
    # drafter that never matches from one accepting half its first drafts), then 64 steps without drafts
    assert 7 * len(ps) <= st.num_spec_drafts <= 8 * len(ps)
    assert st.num_spec_accepted_tokens == 0
    assert st.num_spec_pauses == len(ps)
    assert "paused drafting" in caplog.text
    assert all_free(llm)


class LateOracle(OracleProposer):
    """Wrong drafts for the first `until` output tokens of each sequence, right ones after."""

    def __init__(self, prompts, outs, until: int) -> None:
        super().__init__(prompts, outs)
        self.until = until

    def propose(self, seqs, k):
        right = super().propose(seqs, k)
        return [d if s.num_output_tokens >= self.until else [(t + 1) % 1000 + 100 for t in d]
                for s, d in zip(seqs, right)]


def test_probe_turns_speculation_back_on(checkpoints, plain):
    ps, ref = plain
    llm = _with(make(checkpoints["llama"]), LateOracle(ps, ref, until=12), probe_interval=8)
    assert outputs(llm, ps, GREEDY64) == ref
    st = llm.engine.stats()
    assert st.num_spec_pauses >= len(ps)
    assert st.num_spec_accepted_tokens > 0  # drafting came back once the drafts became right
    assert st.num_spec_paused == 0
    assert all_free(llm)


def test_gate_unit():
    gate = AcceptanceGate(GateSettings(min_acceptance_rate=0.5, probe_interval=3, min_verifies=2, alpha=0.5))
    live = {1, 2}
    assert gate.allow([1, 2], live) == [True, True]
    gate.record(1, 3, 0)
    assert gate.num_paused == 0  # one verify is not enough to judge
    gate.record(1, 3, 0)
    gate.record(2, 3, 3)
    gate.record(2, 3, 3)
    assert gate.num_paused == 1 and gate.num_pauses == 1
    assert gate.allow([1, 2], live) == [False, True]
    assert gate.allow([1, 2], live) == [False, True]
    assert gate.allow([1, 2], live) == [True, True]  # the probe: drafting again, from a fresh average
    assert gate.num_probes == 1 and gate.num_paused == 0
    gate.record(1, 3, 3)
    gate.record(1, 3, 0)  # ewma 0.5: not below
    assert gate.num_paused == 0
    gate.record(1, 3, 0)
    assert gate.num_paused == 1
    gate.allow([2], {2})  # sequence 1 is not running any more: forgotten
    assert gate.num_paused == 0
    never = AcceptanceGate(GateSettings(min_acceptance_rate=0))
    for _ in range(10):
        never.record(1, 3, 0)
    assert never.allow([1], {1}) == [True] and never.num_pauses == 0


@pytest.mark.parametrize("bad", [{"min_acceptance_rate": 1.5}, {"min_acceptance_rate": "x"},
                                 {"probe_interval": 0}])
def test_gate_options_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, **bad})
    cfg = parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2, "min_acceptance_rate": 0.3,
                                    "probe_interval": 16})
    assert (cfg.min_acceptance_rate, cfg.probe_interval) == (0.3, 16)
    assert parse_speculative_config(cfg.to_dict()) == cfg


def test_pause_metrics():
    pytest.importorskip("prometheus_client")
    from lamina.server.metrics import ServerMetrics

    m = ServerMetrics("x")
    codec = Codec()
    for paused, pauses in ((2, 2), (1, 5)):
        stats = EngineStats(1, 0, 10, 10, num_spec_paused=paused, num_spec_pauses=pauses)
        msg = codec.from_core.decode(codec.encode(StepOutputs(1, [], IterationStats(), stats)))
        assert msg.stats == stats
        m.on_iteration(IterationStats(), msg.stats)
    sample = {s.name + str(sorted(s.labels.items())): s.value for fam in m.registry.collect() for s in fam.samples}
    assert sample["lamina:spec_decode_num_pauses_total[('model_name', 'x')]"] == 5
    assert sample["lamina:spec_decode_num_paused_seqs[('model_name', 'x')]"] == 1
    assert isinstance(msgspec.msgpack.encode(stats), bytes)
