"""Reading a launched step back: its sampled tokens land in their sequences (with the token stop checks),
verify steps keep their accepted drafts and give back the rejected positions' blocks and candidate state
slots, and a request's output is built from its sequences.

StepReadback is a part of LLMEngine (engine.py), kept in its own module: it uses the engine's scheduler,
state pool, speculative decoder, detokenizer, request groups, eos ids and max_model_len.
"""
from __future__ import annotations

import time

from lamina.engine.inflight import PENDING, InFlight
from lamina.engine.logprobs import sample_logprobs
from lamina.engine.request import RequestGroup, SeqStatus, Sequence
from lamina.engine.stop import check_token_stop
from lamina.outputs import CompletionOutput, RequestOutput

_FINISHED, _RUNNING = SeqStatus.FINISHED, SeqStatus.RUNNING


class StepReadback:
    def _resolve(self, flight: InFlight, touched: dict[str, RequestGroup], late: list[Sequence] | None = None) -> None:
        """Reads a launched step back. late: a list collects the verify sequences whose prefix-cache registration
        can wait until the next step is launched (_register_late); None: registered here."""
        groups, sched = self.groups, self.scheduler
        for item in flight.scheduled:
            seq = item.seq
            if seq.status is not _FINISHED:
                touched[seq.request_id] = groups[seq.request_id]
                if not item.num_sampled:  # a prompt chunk: its tokens are all known
                    sched.register_computed(seq, seq.num_tokens)
        if flight.draws is None:
            if self.spec is not None:
                self.spec.on_read(None, 0)
            return
        result = flight.draws.finish_copy(flight.copy)
        accepted = flight.num_accepted.tolist() if flight.num_accepted is not None else None
        now = time.monotonic()
        drawn = result.token_ids
        bs, trim_always = sched.block_size, sched.window_group is not None
        snapshots = self.prefix_cache is not None and self.prefix_cache.snapshots is not None
        row = 0
        verified: list[tuple[int, int, int]] = []  # (seq_id, drafts, accepted) for the speculative decoder
        for i, (seq, idx, n) in enumerate(flight.sampled):
            row0, row = row, row + n
            if seq.status is _FINISHED:  # aborted, or stopped on an earlier token while this one was in flight
                continue
            if n == 1:
                self._accept(seq, idx, drawn[row0:row], result, row0, now)
                continue
            # A verify row: the first accepted[i] drafts stood (spec/accept.py); the row after them is the
            # model's. The accepted drafts equal the draws at their rows, except under the bench's forced
            # acceptance (spec/replay.py), where the output follows the drafts.
            a = accepted[i]
            tokens = seq.draft_token_ids[:a]
            tokens.append(drawn[row0 + a])
            seq.draft_token_ids = []
            if a < n - 1:
                seq.num_computed_tokens -= n - 1 - a  # the rejected drafts' KV is overwritten later
                # blocks holding only rejected positions go back to the pool (trim's test, without the call)
                if trim_always or seq.num_computed_tokens + bs <= len(seq.block_table) * bs:
                    sched.trim(seq)
            if seq.candidate_slots:  # recurrent state: commit the one after the last accepted token
                if a < n - 1:
                    # by taking its slot (the old one goes back with the other candidates), not copying it:
                    # a copy was 2 launches per state tensor per sequence (36 at 18 GDN layers, ~2,300 a
                    # step at 64 sequences). Safe: a verify step is read back before the next step is
                    # built, so no launched step still names the old slot, and later ones follow on the
                    # stream. (Tensor parallelism: the slots travel with each step, nothing to replay.)
                    seq.state_slot, seq.candidate_slots[a] = seq.candidate_slots[a], seq.state_slot
                sched.free_candidates(seq)
            verified.append((seq.seq_id, n - 1, a))
            if self._no_stop_within(seq, idx, tokens):
                # The usual case, in one slice (see _accept): the PENDING placeholder becomes the run.
                if seq.first_token_time is None:
                    seq.first_token_time = now
                seq.token_ids[idx:idx + 1] = tokens
                if late is None:
                    sched.register_computed(seq, idx + len(tokens))
                else:
                    late.append(seq)
            else:
                seq.token_ids[idx + 1:idx + 1] = [PENDING] * a
                self._accept(seq, idx, tokens, result, row0, now)
            if snapshots and seq.status is not _FINISHED:  # a prefix-cache snapshot only at an accepted position
                sched.snapshot(seq)
        if verified and self.spec is not None:
            self.spec.record_many(verified)
        if self.spec is not None:  # the goodput gate times the step (spec/goodput.py)
            self.spec.on_read(flight.gate_sample, sum(a for _, _, a in verified))

    def _register_late(self, seqs: list[Sequence]) -> None:
        """The prefix-cache registration _resolve left for after the next launch (the blocks a verify step's
        accepted tokens filled): as _commit registers, the tokens still in flight excluded. Sequences that the
        launched step scheduled were registered by its _commit already (a no-op here); one preempted or
        finished meanwhile is skipped (its blocks went back unregistered: a lost cache hit, never a wrong one)."""
        sched = self.scheduler
        for seq in seqs:
            if seq.status is _RUNNING:
                sched.register_computed(seq, seq.num_tokens - (seq.token_ids[-1] == PENDING))

    def _accept(self, seq: Sequence, idx: int, tokens: list[int], result, row0: int, now: float) -> None:
        """Puts a sequence's new tokens at token_ids[idx:], one at a time with the token stop checks."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        if self._no_stop_within(seq, idx, tokens):
            # The common case in one slice: no matcher, no logprobs, and no token of the run can end it (none
            # is a stop id or an EOS it stops on, and the last stays short of both length limits), so the
            # per-token loop below would only assign them (~25 us a verify step and sequence on the bench CPU).
            seq.token_ids[idx:idx + len(tokens)] = tokens
            self.scheduler.register_computed(seq, idx + len(tokens))
            return
        for j, token in enumerate(tokens):
            pos = idx + j
            seq.token_ids[pos] = token
            if seq.grammar is not None:
                seq.grammar.push(token)  # the matcher takes it with the next fill (structured/state.py)
            if seq.logprobs is not None:
                seq.logprobs.append(sample_logprobs(result, row0 + j, token, self.detokenizer))
                seq.cumulative_logprob += result.chosen_logprobs[row0 + j]
            check_token_stop(seq, token, pos + 1 - seq.num_prompt_tokens, self.eos_token_ids, self.max_model_len)
            if seq.finish_reason is not None:
                del seq.token_ids[pos + 1:]  # drop tokens sampled after the stop
                self.scheduler.finish(seq)
                return
        self.scheduler.register_computed(seq, idx + len(tokens))

    def _no_stop_within(self, seq: Sequence, idx: int, tokens: list[int]) -> bool:
        """Whether check_token_stop cannot end the sequence on any of `tokens` (placed at token_ids[idx:]), and
        nothing else per token is due (a grammar to push, logprobs to record). Conservative: a stop id or EOS
        among them sends the run through the per-token loop even while min_tokens would ban it."""
        if seq.grammar is not None or seq.logprobs is not None:
            return False
        n_last = idx + len(tokens) - seq.num_prompt_tokens  # output index of the last token
        if n_last >= seq.max_tokens or seq.num_prompt_tokens + n_last >= self.max_model_len:
            return False
        p = seq.params
        if p.stop_token_ids and any(map(p.stop_token_ids.__contains__, tokens)):  # (no generator: per sequence)
            return False
        return p.ignore_eos or not any(map(self.eos_token_ids.__contains__, tokens))

    def _output(self, group: RequestGroup) -> RequestOutput:
        outs = []
        for s in group.seqs:
            ids = s.output_token_ids
            if ids and ids[-1] == PENDING:  # the token of the step still in flight is not known yet
                ids.pop()
            # Copies: a streaming consumer on another thread must not see these lists grow.
            outs.append(CompletionOutput(s.index, "", ids, s.cumulative_logprob if s.logprobs is not None
                                         else None, None if s.logprobs is None else list(s.logprobs),
                                         s.finish_reason, s.stop_reason))
        first = group.seqs[0]
        metrics = {"arrival_time": group.arrival_time}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        scheduled = [s.first_scheduled_time for s in group.seqs if s.first_scheduled_time is not None]
        if scheduled:
            metrics["first_scheduled_time"] = min(scheduled)
        metrics["num_preemptions"] = sum(s.num_preemptions for s in group.seqs)
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, outs, group.finished,
                             first.prompt_logprobs, first.num_cached_tokens, group.error, metrics)
