"""The goodput gate (spec/goodput.py): drafting only at batch sizes where it delivers more tokens/s than plain
decoding, measured from the step loop's own timestamps. A fake clock makes the costs deterministic: each
launched step advances it by a plain or a verify step's cost at that batch size. Outputs never change and
every block is free afterwards."""
from __future__ import annotations

import logging

import pytest
from spec_helpers import OracleProposer, all_free, make, outputs, spec_prompts

from lamina import SamplingParams
from lamina.spec.config import parse_speculative_config
from lamina.spec.decoder import SpecDecoder
from lamina.spec.goodput import GoodputGate, GoodputSettings, bucket_of


class FakeClock:
    """Time moves only when a step launches: by `cost(rows, verify)` (rows: sequences sampled)."""

    def __init__(self, cost) -> None:
        self.t, self.cost = 0.0, cost
        self.steps: list[tuple[int, bool]] = []  # (rows, verify) of every launched step

    def __call__(self) -> float:
        return self.t

    def install(self, llm) -> None:
        runner = llm.engine.runner
        prepare = runner.prepare

        def timed(scheduled, pending=None):
            rows = sum(1 for it in scheduled if it.num_sampled)
            verify = any(it.num_sampled > 1 for it in scheduled)
            self.steps.append((rows, verify))
            self.t += self.cost(rows, verify)
            return prepare(scheduled, pending)
        runner.prepare = timed


def by_batch(rows: int, verify: bool) -> float:
    """Plain: 1 ms. Verify: 1.1x plain at batch 1 (weights-bound), 4x at a larger batch (compute-bound)."""
    return 1e-3 * ((1.1 if rows == 1 else 4.0) if verify else 1.0)


class FirstRight(OracleProposer):
    """The first draft right, the others wrong: 2 tokens per sequence and verify step."""

    def propose(self, seqs, k):
        return [d[:1] + [(t + 1) % 1000 + 100 for t in d[1:]] for d in super().propose(seqs, k)]


def _spec(llm, proposer, clock, **opts):
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "probe_interval": 16, **opts})
    llm.engine.spec = SpecDecoder(cfg, proposer, clock=clock)
    clock.install(llm)
    return llm


@pytest.fixture(scope="module")
def ref(checkpoints, one_thread):
    """8 prompts: 7 short generations, 1 long one (the batch shrinks to 1), and their plain outputs."""
    ps = spec_prompts(8, seed=47)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in [24] * 7 + [120]]
    return ps, params, outputs(make(checkpoints["llama"]), ps, params)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_off_at_large_batch_on_at_batch_1(checkpoints, ref, async_scheduling, caplog):
    ps, params, want = ref
    clock = FakeClock(by_batch)
    llm = _spec(make(checkpoints["llama"], async_scheduling=async_scheduling), FirstRight(ps, want), clock)
    with caplog.at_level(logging.INFO, logger="lamina"):
        assert outputs(llm, ps, params) == want
    full = [v for rows, v in clock.steps if rows == 8]
    alone = [v for rows, v in clock.steps if rows == 1]
    # at 8: plain samples, a few measured verify steps (2 tokens at 4x the cost: 0.5x), then plain
    assert len(full) >= 12 and sum(full) <= 5 and not any(full[-6:])
    # alone: plain samples, then verify steps (2 tokens at 1.1x: 1.8x) for the rest
    assert sum(alone) >= 0.7 * len(alone) and all(alone[-10:-2])
    st = llm.engine.stats()
    assert st.num_spec_goodput_offs >= 1 and st.num_spec_goodput_ons >= 1
    assert st.num_spec_verify_steps == sum(v for _, v in clock.steps)
    assert st.num_spec_plain_steps == sum(not v for _, v in clock.steps)
    assert "does not pay at batch <= 8" in caplog.text and "pays at batch <= 1" in caplog.text
    assert all_free(llm)


def test_acceptance_zero_turns_off(checkpoints, ref):
    ps, params, want = ref
    ps, params, want = ps[-1:], params[-1:], want[-1:]  # batch 1, where a verify step costs only 1.1x
    clock = FakeClock(by_batch)
    # per-sequence pauses off: the goodput gate alone turns drafting off
    llm = _spec(make(checkpoints["llama"]), OracleProposer(ps, want, wrong=True), clock, min_acceptance_rate=0,
                gate="goodput")
    assert outputs(llm, ps, params) == want
    verify = [v for _, v in clock.steps]
    # 10 measured, then 16 plain, a probe of 10, 32 plain, a probe of 10, 64 plain: 30 of ~120 steps. Each
    # sequence gets exactly 1 token, but 3 such samples are no proof (at acceptance 0.5 they come 1 time in 8:
    # GoodputSettings.prior_var); at a verify step's 1.1x, ~10 are (and cost a tenth of a step each)
    assert sum(verify) <= 32 and llm.engine.stats().num_spec_accepted_tokens == 0
    assert llm.engine.spec.goodput.num_offs >= 2 and llm.engine.spec.goodput.num_ons == 0
    assert all_free(llm)


def test_gate_off_and_acceptance_keep_drafting(checkpoints, ref):
    """gate "off" drafts at every step whatever it costs (the old behaviour with min_acceptance_rate 0)."""
    ps, params, want = ref
    clock = FakeClock(by_batch)
    llm = _spec(make(checkpoints["llama"]), FirstRight(ps, want), clock, gate="off")
    assert outputs(llm, ps, params) == want
    decode = [v for rows, v in clock.steps if rows]
    assert sum(decode) >= 0.9 * len(decode) and llm.engine.spec.goodput is None
    assert all_free(llm)


def _feed(gate, batch, plain_dt, spec_dt, tokens, steps):
    """Runs `steps` steps of `batch` sequences; returns how many drafted."""
    n = 0
    for _ in range(steps):
        on = gate.allow(batch)
        gate.record(on, batch, spec_dt if on else plain_dt, tokens if on else 1.0)
        n += on
    return n


def test_gate_unit():
    s = GoodputSettings(margin=0.05, min_samples=2, probe_interval=4, max_backoff=4, refresh_interval=10)
    gate = GoodputGate(s)
    assert [bucket_of(b) for b in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert not gate.would_allow(1) and not gate.allow(1)  # a new bucket measures plain first
    gate.record(False, 1, 1.0)
    gate.record(False, 1, 1.0)
    assert gate.would_allow(1) and gate.allow(1)  # then drafts to measure
    gate.record(True, 1, 1.0, 2.0)
    gate.record(True, 1, 1.0, 2.0)
    assert gate.buckets[1].on and gate.num_ons == 1 and gate.speedup(1) == pytest.approx(2.0)
    # 1.02x: not enough to turn on (margin), but enough to stay on (hysteresis)
    assert _feed(gate, 1, 1.0, 1.0, 1.02, 8) == 8 and gate.num_offs == 0
    # refresh: after refresh_interval steps on, plain is measured again, then drafting resumes
    drafted = [_feed(gate, 1, 1.0, 1.0, 2.0, 1) for _ in range(6)]
    assert 0 in drafted and drafted[-1] == 1 and gate.buckets[1].on
    # losing (0.33x): off after a few samples (one does not flip it), probed after probe_interval steps; a probe
    # that loses again doubles the wait
    n = 0
    while gate.buckets[1].on and n < 20:
        gate.record(True, 1, 3.0, 1.0)
        n += 1
    assert 2 <= n <= 10 and not gate.buckets[1].on and gate.num_offs == 1 and gate.buckets[1].off_for == 4
    pattern = [_feed(gate, 1, 1.0, 3.0, 1.0, 1) for _ in range(5 + 9 + 17)]
    assert pattern == [0, 0, 0, 1, 1] + [0] * 7 + [1, 1] + [0] * 15 + [1, 1]
    assert gate.buckets[1].off_for == 16 and gate.num_offs == 4  # max_backoff
    # another bucket has its own verdict
    assert not gate.allow(64) and gate.buckets[1].off_for == 16


def test_step_time_outliers():
    """A step time far off (a compile, a GC pause, the first step after a switch) among the first samples does
    not set the average (their median does); after them it counts as `outlier` times the average."""
    gate = GoodputGate(GoodputSettings(min_samples=3))
    for dt in (100.0, 1.0, 1.0):
        gate.record(False, 8, dt)
    assert gate.buckets[8].plain_dt == pytest.approx(1.0)
    gate.record(False, 8, 100.0)
    assert gate.buckets[8].plain_dt == pytest.approx(1.75)  # 1 + (4 - 1) / 4
    # drafting at 1.2x the plain step and 1.875 tokens (acceptance 0.5, K = 3): the first verify step took a
    # second (a compile): on at once, where the mean of the first three (0.34 s) read as 0.006x plain: off
    for dt in (1000.0, 1.2, 1.2):
        assert gate.allow(8)
        gate.record(True, 8, dt, 1.875)
    assert gate.buckets[8].on and gate.num_offs == 0 and gate.speedup(8) == pytest.approx(1.875 / 1.2 * 1.75)


def test_noisy_tokens_measure_longer():
    """At batch 1 the accepted length varies from step to step: the probe measures until the verdict is clear
    (or max_samples); at acceptance 0 (no spread) it decides after min_samples."""
    s = GoodputSettings(min_samples=3, probe_interval=4, max_samples=32)
    gate = GoodputGate(s)
    for _ in range(3):
        gate.record(False, 1, 1.0)
    noisy = [1.0, 4.0, 1.0, 2.0, 4.0, 1.0, 1.0, 3.0, 4.0, 1.0, 2.0, 4.0]  # mean 2.3 at 1.1x: ~2.1x
    n = 0
    while gate.buckets[1].probing and n < len(noisy):
        assert gate.allow(1)
        gate.record(True, 1, 1.1, noisy[n])
        n += 1
    assert 3 < n < len(noisy) and gate.buckets[1].on
    zero = GoodputGate(s)
    for _ in range(3):
        zero.record(False, 64, 1.0)
    for _ in range(3):
        zero.record(True, 64, 1.1, 1.0)
    assert zero.num_offs == 1 and zero.buckets[64].off_for == 4


def test_config():
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    assert (cfg.gate, cfg.gate_margin) == ("goodput", 0.05)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 0}).gate \
        == "off"
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "gate": "acceptance",
                                    "gate_margin": 0.2})
    assert parse_speculative_config(cfg.to_dict()) == cfg
    for bad in ({"gate": "on"}, {"gate_margin": -1}, {"gate_margin": "x"}):
        with pytest.raises(ValueError, match="gate"):
            parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, **bad})
