"""Speculation only where it pays: the goodput gate measures, online, the tokens per second the step loop
delivers with drafting on and with it off, per batch-size bucket, and drafts only where drafting wins.

Acceptance alone cannot say whether speculation pays: a verify step of K+1 rows per sequence costs about as
much as a plain step at batch 1 (weights-bound), but several times as much at a large batch (compute-bound),
and it must be read back before the next step is built, so the host no longer overlaps the device (measured
on an H200 with SmolLM2-135M, K = 3: ngram at 32 concurrent accepted 60% of its drafts yet ran at 0.60x the
plain throughput; at batch 1, 1.21x).

What is measured is what the user sees: the interval between two consecutive step results (the step loop's
own timestamps, after_step of SpecDecoder), attributed to the step read back in that interval. Under async
scheduling a plain step is read back one call late, so a clean interval needs exactly one step read back in
this call and at least one in the previous; the intervals around a switch between overlapped and synced
steps are dropped (SpecDecoder does this). Steps holding a prompt chunk are not samples either, nor a step
with drafting on that verified no draft (its sequences paused or their last token in flight: a plain step's
cost and 1 token, which read as drafting that does not pay), nor a plain step held for the next one's drafts.

Per bucket (the number of decoding sequences rounded up to a power of two): an EWMA of the plain step's
interval, and with drafting on an EWMA of the interval and of the tokens each sequence got from the step
(1 + its accepted drafts; a sequence without drafts that step gets 1). Speculation pays when
tokens / interval (with) > (1 + margin) / interval (without). A new bucket first runs `min_samples` clean
plain steps, then at least `min_samples` with drafting on, until the verdict is clear: the tokens' average
give or take two standard errors (one sequence's accepted length varies a lot from step to step, at
acceptance 0.5 and K = 3 1.9 +- 1.1 tokens, so batch 1 measures longer; at acceptance 0 or a large batch 3
steps do) on one side of the threshold, or `max_samples` steps. Once on, it stays on until it clearly loses
(hysteresis: below plain, no margin), and re-measures plain every `refresh_interval` steps on (context grows,
costs drift). Off, the bucket decodes plainly for `probe_interval` of its steps, then probes with drafting on
again, the interval doubling after each probe that still loses (up to `max_backoff` times), reset by one that
wins. A batch that shrinks or grows moves to another bucket with its own verdict, so speculation comes back
at batch 1 while staying off at 64.

Deterministic to test: the clock is injected (SpecDecoder's `clock`), and samples arrive through record().
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("lamina")


@dataclass
class GoodputSettings:
    margin: float = 0.05  # drafting turns on only when it beats plain tokens/s by this fraction
    min_samples: int = 3  # clean intervals of each mode a bucket needs before it decides
    max_samples: int = 32  # intervals with drafting on after which a probe decides, clear or not
    alpha: float = 0.1  # weight of the newest sample in the averages (a plain mean over the first 1/alpha)
    probe_interval: int = 64  # a bucket's steps with drafting off before it is probed again (times the backoff)
    max_backoff: int = 16
    refresh_interval: int = 512  # a bucket's steps with drafting on before its plain cost is measured again
    outlier: float = 4.0  # a sample above this multiple of its average counts as this multiple (a GC pause)
    # The tokens' spread before many samples: `prior_n` samples of this variance per sequence (over the batch)
    # join the measured ones. A few identical samples do not show there is no spread: at acceptance 0.5 and
    # K = 3 a sequence gets 1 token from 3 verify steps in a row 1 time in 8, and with 0 spread those read as
    # a clear loss (a quarter of a token squared: about the spread of an acceptance of 0.2, near break-even).
    prior_var: float = 0.25
    prior_n: float = 3.0


@dataclass
class _Bucket:
    plain_dt: float | None = None  # EWMA seconds per plain step
    plain_n: int = 0  # plain samples since the plain average was (re)started
    plain_first: list[float] | None = None  # its first min_samples samples (their median starts the average)
    spec_dt: float | None = None  # EWMA seconds per step with drafting on
    spec_tok: float | None = None  # EWMA tokens per sequence per step with drafting on
    spec_tok2: float | None = None  # ... and of their square (the samples' spread)
    spec_n: int = 0  # samples with drafting on since the last probe
    spec_first: list[float] | None = None
    on: bool = False  # decided: drafting pays (else: measuring, or off)
    off_for: int = 0  # the bucket's steps left with drafting off
    backoff: int = 1
    probing: bool = True  # measuring drafting before a verdict (a new bucket, or after off_for ran out)
    since_plain: int = 0  # steps on since plain was last measured
    was_off: bool = False  # the last verdict was off (a probe that loses again doubles the backoff)


def bucket_of(batch: int) -> int:
    """The power of two at or above `batch` (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch - 1).bit_length()


class GoodputGate:
    def __init__(self, settings: GoodputSettings | None = None) -> None:
        self.s = settings or GoodputSettings()
        self.buckets: dict[int, _Bucket] = {}
        self.num_offs = 0  # cumulative: times a bucket's drafting turned off because it did not pay
        self.num_ons = 0  # cumulative: times a bucket's drafting was found to pay (after measuring or a probe)

    def _ready_plain(self, b: _Bucket) -> bool:
        return b.plain_n >= self.s.min_samples

    def allow(self, batch: int) -> bool:
        """One step with `batch` sequences about to decode: whether they may draft (moves the bucket's counts)."""
        key = bucket_of(batch)
        b = self.buckets.setdefault(key, _Bucket())
        if not self._ready_plain(b):  # never measured plainly (or refreshing): plain steps first
            return False
        if b.off_for > 0:
            b.off_for -= 1
            if b.off_for == 0:  # probe: drafting back on, judged by fresh averages
                b.spec_dt = b.spec_tok = b.spec_tok2 = b.spec_first = None
                b.spec_n, b.probing = 0, True
                log.info("speculative decoding: probing whether drafting pays at batch <= %d again", key)
            return b.off_for == 0
        if b.on:
            b.since_plain += 1
            if b.since_plain >= self.s.refresh_interval:  # plain cost drifts too: measure it again
                b.plain_dt, b.plain_n, b.since_plain, b.plain_first = None, 0, 0, None
                return False
        return True

    def would_allow(self, batch: int) -> bool:
        """Whether the next allow(batch) will let sequences draft (it moves nothing)."""
        b = self.buckets.get(bucket_of(batch))
        if b is None or not self._ready_plain(b):
            return False
        if b.off_for > 0:
            return b.off_for == 1
        return not (b.on and b.since_plain + 1 >= self.s.refresh_interval)

    def _avg(self, old: float | None, n: int, new: float) -> float:
        """The average after its (n+1)-th sample: a plain mean at first, then an EWMA."""
        if old is None:
            return new
        return old + max(self.s.alpha, 1.0 / (n + 1)) * (new - old)

    def _time(self, old: float | None, n: int, first: list[float], new: float) -> float:
        """A step time's average after its (n+1)-th sample. The median of the first min_samples (a switch's
        first step, a compile or a GC pause among them moves a mean by a third of itself, easily enough to
        turn a winner off), then an EWMA whose outliers count as `outlier` times the average."""
        if n < self.s.min_samples:
            first.append(new)
            first.sort()
            mid = len(first) // 2
            return first[mid] if len(first) % 2 else 0.5 * (first[mid - 1] + first[mid])
        return self._avg(old, n, min(new, self.s.outlier * old))

    def _spread(self, key: int, b: _Bucket) -> float:
        """Two standard errors of the tokens' average: its samples' spread, with prior_n samples of prior_var
        per sequence (see GoodputSettings), over the samples (an EWMA counts ~(2-a)/a of them)."""
        s = self.s
        n = min(b.spec_n, (2.0 - s.alpha) / s.alpha)
        var = max(0.0, b.spec_tok2 - b.spec_tok * b.spec_tok)
        var = (n * var + s.prior_n * s.prior_var / key) / (n + s.prior_n)
        return 2.0 * (var / n) ** 0.5

    def record(self, drafting: bool, batch: int, seconds: float, tokens_per_seq: float = 1.0) -> None:
        """A clean step interval: `batch` sequences decoded in `seconds`, drafting on or off for the step,
        each sequence getting `tokens_per_seq` tokens on average (1 plainly)."""
        key = bucket_of(batch)
        b = self.buckets.setdefault(key, _Bucket())
        if not drafting:
            if b.plain_first is None:
                b.plain_first = []
            b.plain_dt = self._time(b.plain_dt, b.plain_n, b.plain_first, seconds)
            b.plain_n += 1
            if b.plain_n == self.s.min_samples and b.on:  # a refresh: does drafting still pay?
                self._judge(key, b)
            return
        if b.off_for > 0 or not self._ready_plain(b):  # a step launched before the verdict changed
            return
        if b.spec_first is None:
            b.spec_first = []
        b.spec_dt = self._time(b.spec_dt, b.spec_n, b.spec_first, seconds)
        b.spec_tok = self._avg(b.spec_tok, b.spec_n, tokens_per_seq)
        b.spec_tok2 = self._avg(b.spec_tok2, b.spec_n, tokens_per_seq * tokens_per_seq)
        b.spec_n += 1
        if b.spec_n >= self.s.min_samples:
            self._judge(key, b)

    def speedup(self, batch: int) -> float | None:
        """Measured tokens/s with drafting over without, at this batch's bucket (None: not measured yet)."""
        b = self.buckets.get(bucket_of(batch))
        if b is None or b.plain_dt is None or b.spec_dt is None or b.spec_tok is None:
            return None
        return b.spec_tok / b.spec_dt * b.plain_dt

    def _judge(self, key: int, b: _Bucket) -> None:
        per_token = b.plain_dt / b.spec_dt  # speed-up per token each sequence gets from a step
        ratio, spread = b.spec_tok * per_token, self._spread(key, b) * per_token
        if b.probing:
            bar = 1.0 + self.s.margin
            clear = ratio - spread > bar or ratio + spread < bar or b.spec_n >= self.s.max_samples
            if not clear:
                return  # measure on
            if ratio > bar:
                b.on, b.probing, b.was_off, b.backoff, b.since_plain = True, False, False, 1, 0
                self.num_ons += 1
                log.info("speculative decoding: drafting pays at batch <= %d (%.2fx the plain tokens/s, %.2f "
                         "tokens per sequence and step): on", key, ratio, b.spec_tok)
                return
            # a first measurement or a probe that lost: off, for twice as long after each probe in a row that loses
            b.backoff = min(self.s.max_backoff, b.backoff * 2) if b.was_off else 1
        elif ratio + spread >= 1.0:  # on and not clearly losing
            return
        else:
            b.backoff = 1
        b.on, b.probing, b.was_off = False, False, True
        b.off_for = self.s.probe_interval * b.backoff
        self.num_offs += 1
        log.info("speculative decoding: drafting does not pay at batch <= %d (%.2fx the plain tokens/s, %.2f "
                 "tokens per sequence and step): off for %d steps at that batch", key, ratio, b.spec_tok,
                 b.off_for)
