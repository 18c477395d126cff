"""The engine's side of structured output and of the logits controls that need the newest tokens.

The engine asks, per request, whether it must wait for a grammar (hold / ready), and per step whether
any sampled row is constrained by host state (constrains); if so it reads the step in flight back
first (its tokens advance the grammars) and starts the step's bitmask here (start_bitmask), filled on the
host by the filler's threads (structured/fill.py) while the step is built and its forward runs, shipped in
one non-blocking copy, applied inside the sampler.

Rows constrained by host state: a grammar (xgrammar matcher), or multi-token bad words (the last token
of a bad word is banned when the output ends with the rest of it).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
from dataclasses import dataclass, field
from functools import partial

import torch

from lamina.engine.request import RequestGroup, Sequence
from lamina.sampling_params import SamplingParams
from lamina.structured.bitmask import ALL_ALLOWED, BitmaskBuffers
from lamina.structured.compiler import GrammarCompilerService, build_grammar, host_bounds_whitespace
from lamina.structured.fill import MaskFiller, PendingFill
from lamina.structured.state import GrammarState
from lamina.structured.whitespace import MAX_RUN, ban_long_runs

log = logging.getLogger("lamina")
IDLE_WAIT_S = 0.005  # how long an engine with nothing else to run waits for a grammar per step


def tokenize_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, alone and after a space (how it appears mid-text), deduplicated."""
    out: list[list[int]] = []
    for w in words:
        for variant in (w, " " + w.lstrip()):
            ids = list(tokenizer(variant, add_special_tokens=False).input_ids)
            if ids and ids not in out:
                out.append(ids)
    return out


def multi_token_bad_words(params: SamplingParams) -> list[list[int]]:
    return [w for w in params.bad_words_token_ids or [] if len(w) > 1]


def sampled_rows(scheduled) -> tuple[list[Sequence], list[int]]:
    """The sampled rows of a step of `scheduled` (ScheduledSeq items) before it is built, as the runner lays
    them out (ForwardBatch.sampled, .offsets): each sequence's num_sampled rows in scheduled order."""
    rows: list[Sequence] = []
    offsets: list[int] = []
    for item in scheduled:  # one loop, no range per row: ~70 us at 64 rows on the development machine before
        n = item.num_sampled
        if n == 1:
            rows.append(item.seq)
            offsets.append(0)
        elif n:
            rows.extend([item.seq] * n)
            offsets.extend(range(n))
    return rows, offsets


@dataclass
class StepMask:
    """A step's token bitmask: row i of `bitmask` (int32 [N, ceil(vocab / 32)], on the device) masks sampled
    row `host_rows[i]`; `rows` is host_rows on the device, None when N is every sampled row in order."""

    bitmask: torch.Tensor
    rows: torch.Tensor | None
    host_rows: list[int]


@dataclass
class _Held:
    group: RequestGroup
    future: cf.Future
    states: list = field(default_factory=list)


class StructuredOutputManager:
    """Owns the grammar compiler (built on the first constrained request) and the requests waiting for
    their grammars. Not thread-safe: the engine's thread calls it."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.device = device
        self._compiler = None
        self._held: dict[str, _Held] = {}
        self._buffers = BitmaskBuffers(vocab_size, device)
        self._filler = MaskFiller()  # the fill's threads (LAMINA_GRAMMAR_FILL_THREADS), made on first use

    @property
    def _ws(self) -> bool:
        """Some grammar may have its whitespace bounded on the host (structured/whitespace.py)."""
        return self._compiler is not None and self._compiler.ws_tables is not None

    @property
    def compiler(self):
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer")
            self._compiler = GrammarCompilerService(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._compiler

    def prepare(self, params: SamplingParams) -> None:
        """Checks a new request's constraint (StructuredOutputsError, a ValueError, if invalid) and fills
        the bad words' token ids."""
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise ValueError("bad_words need the model's tokenizer")
            params.bad_words_token_ids = tokenize_bad_words(self.tokenizer, params.bad_words)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer")
            # No tokenizer work, but 0.2-0.5 ms for the bench schema on the step loop: skipped for a constraint
            # that compiled already (the hot path: every request of an agent's tool set has the same one).
            if self._compiler is None or not self._compiler.compiled(params.structured_outputs):
                build_grammar(params.structured_outputs)

    def hold(self, group: RequestGroup) -> bool:
        """Starts compiling the group's grammar; True if it must wait (ready() releases it), False if its
        sequences have their grammar states and can be scheduled now."""
        spec = group.seqs[0].params.structured_outputs
        if spec is None:
            return False
        fut = self.compiler.submit(spec)
        if fut.done() and fut.exception() is None:
            self._attach(group, fut.result())
            return False
        self._held[group.request_id] = _Held(group, fut)
        return True

    def _attach(self, group: RequestGroup, compiled) -> None:
        spec = group.seqs[0].params.structured_outputs
        ws = self.compiler.ws_tables if host_bounds_whitespace(spec) else None
        for seq in group.seqs:
            seq.grammar = GrammarState(compiled, ws)

    def ready(self, idle: bool) -> list[tuple[RequestGroup, str | None]]:
        """Held groups whose grammar is done: (group, None) with states attached, or (group, error).
        idle: the engine has nothing else to run, so wait a little instead of spinning."""
        if not self._held:
            return []
        if idle:
            cf.wait([h.future for h in self._held.values()], IDLE_WAIT_S, cf.FIRST_COMPLETED)
        out = []
        for rid in [r for r, h in self._held.items() if h.future.done()]:
            h = self._held.pop(rid)
            exc = h.future.exception()
            if exc is not None:
                log.error("grammar compilation failed for %s: %s", rid, exc)
                out.append((h.group, f"grammar compilation failed: {exc}"))
                continue
            self._attach(h.group, h.future.result())
            out.append((h.group, None))
        return out

    def discard(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    @property
    def held_ids(self) -> set[str]:
        """Requests waiting for their grammar (they count as waiting)."""
        return set(self._held)

    @staticmethod
    def constrains(rows: list[Sequence]) -> bool:
        return any(s.grammar is not None or multi_token_bad_words(s.params) for s in rows)

    def bitmask(self, rows: list[Sequence], offsets: list[int]) -> StepMask | None:
        """start_bitmask(rows, offsets, background=False).result(): the step's mask, filled now."""
        pending = self.start_bitmask(rows, offsets, background=False)
        return pending.result() if pending is not None else None

    def start_bitmask(self, rows: list[Sequence], offsets: list[int], background: bool = True) -> PendingMask | None:
        """Starts filling the step's bitmask for the sampled rows that have something to mask (a grammar not
        terminated yet, multi-token bad words); None if no row has. The sequences' tokens must all be known
        (no step in flight). background: the fill runs on the filler's threads while the caller goes on
        (building and running the forward), and the matchers of these rows are the filler's until result()
        or cancel(): the caller must not accept tokens or fill again meanwhile."""
        fast = _decode_states(rows, offsets)
        if fast is not None:  # every row one live grammar, nothing else to mask: the usual decode step
            count = len(fast)
            host = self._buffers.host(count, blank=False)  # the batch fill writes every row
            fill_rows = list(range(count))
            fill = self._filler.start(host, fast, fill_rows, [], count, background)
            long = [(i, g) for i, g in enumerate(fast) if g.ws is not None and g.ws_run >= MAX_RUN] if self._ws else ()
            return PendingMask(self, host, fill_rows, True, fill, [], long)
        runs = []  # (first row, row count, sequence, its multi-token bad words) of the rows to mask
        r, total = 0, len(rows)
        while r < total:
            seq = rows[r]
            n = 1
            while r + n < total and rows[r + n] is seq and offsets[r + n] == n:
                n += 1
            grammar = seq.grammar
            words = multi_token_bad_words(seq.params) if seq.params.bad_words_token_ids else None
            if (words or (grammar is not None and not grammar.done)) and not seq.finished:
                runs.append((r, n, seq, words))
            r += n
        count = sum(run[1] for run in runs)
        if not count:
            return None  # nothing to mask: the sampler skips the copy and the apply
        # The batch fill writes whole rows (xgrammar 0.2.9), so only the other rows are set to all ones first:
        # the 1.2 MB memset at 64 rows was host_buf ~205 us a step on the H200 host.
        host = self._buffers.host(count, blank=False)
        states, fill_rows, jobs, bans, logit_rows = [], [], [], [], []  # bans: (row, token) of bad words
        long = []  # (row, grammar state) of rows at the end of a long whitespace run (structured/whitespace.py)
        h = 0
        for r, n, seq, words in runs:
            logit_rows.extend(range(r, r + n))
            grammar = seq.grammar
            if n == 1 and grammar is not None and not grammar.done:  # one batch accept + fill (fill.py)
                states.append(grammar)
                fill_rows.append(h)
            else:  # bad words only, or a verify run: each row after a draft, so one at a time (accept, fill,
                host[h:h + n].numpy().fill(ALL_ALLOWED)  # roll back); a state that ends leaves it all ones
                if grammar is not None and not grammar.done:
                    jobs.append(partial(grammar.fill, host, h, list(seq.draft_token_ids), n))
            if grammar is not None and grammar.ws is not None and not grammar.done:
                long.extend((h + j, grammar) for j in range(n)
                            if grammar.ws.run_after(grammar.ws_run, seq.draft_token_ids[:j]) >= MAX_RUN)
            if words:
                out = seq.output_token_ids
                for j in range(n):
                    bans.extend((h + j, t) for t in _bad_word_bans(out + seq.draft_token_ids[:j], words))
            h += n
        fill = self._filler.start(host, states, fill_rows, jobs, count, background)
        return PendingMask(self, host, logit_rows, count == len(rows), fill, bans, long)

    def close(self) -> None:
        """Stops the fill threads (they are made again if needed)."""
        self._filler.close()


class PendingMask:
    """A step's bitmask being filled on the host. result() waits for the fill, bans the bad words' tokens and
    starts the host-to-device copies; cancel() only waits (a step that failed before sampling)."""

    def __init__(self, manager: StructuredOutputManager, host: torch.Tensor, logit_rows: list[int], every: bool,
                 fill: PendingFill, bans: list[tuple[int, int]], long=()) -> None:
        self._buffers = manager._buffers
        self.host, self.logit_rows, self.every = host, logit_rows, every
        self._fill, self._bans, self._long = fill, bans, long

    def result(self) -> StepMask:
        self._fill.wait()
        if self._long:  # after the fill (whole rows written); a state that ended meanwhile keeps its all-ones row
            live = [(r, g.ws) for r, g in self._long if not g.done]
            ban_long_runs(self.host, [r for r, _ in live], [w for _, w in live])
        for row, t in self._bans:  # after the fill, which writes whole rows
            _ban(self.host, row, t)
        rows = None if self.every else self._buffers.rows_to_device(self.logit_rows)
        return StepMask(self._buffers.to_device(self.host), rows, self.logit_rows)

    def cancel(self) -> None:
        try:
            self._fill.wait()
        except Exception:  # the step failed already; its own error is the one reported
            pass


def _decode_states(rows: list[Sequence], offsets: list[int]) -> list | None:
    """The rows' grammar states when every row is its sequence's only one (no verify run), unfinished, with a
    grammar not done and no bad words; else None (start_bitmask's general path). One tight loop: the general
    one cost ~150 us at 64 rows on the development machine."""
    states = []
    for seq, off in zip(rows, offsets):
        g = seq.grammar
        if off or g is None or g.done or seq.finished or seq.params.bad_words_token_ids:
            return None
        states.append(g)
    return states or None


def _bad_word_bans(output: list[int], words: list[list[int]]) -> list[int]:
    """The last tokens of the bad words whose other tokens end `output`."""
    out = []
    for w in words:
        prefix = w[:-1]
        if len(output) >= len(prefix) and output[len(output) - len(prefix):] == prefix:
            out.append(w[-1])
    return out


def _ban(host: torch.Tensor, row: int, t: int) -> None:
    host[row, t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF


def _ban_bad_words(host: torch.Tensor, row: int, output: list[int], words: list[list[int]]) -> None:
    for t in _bad_word_bans(output, words):
        _ban(host, row, t)
