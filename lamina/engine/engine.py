"""LLMEngine: requests in, one scheduled forward per step, tokens and text out.

Every exit path of a sequence (finish, abort, error) goes through Scheduler.finish, which returns its
blocks; preemption returns them too and the sequence is recomputed later.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

from lamina.cache.block_allocator import BlockAllocator
from lamina.cache.prefix_cache import PrefixCache
from lamina.config import EngineConfig
from lamina.engine.build import build_graphs, build_pools, load_model_and_tokenizer
from lamina.engine.detokenizer import Detokenizer, initial_state
from lamina.engine.logprobs import prompt_logprobs_for_chunk, sample_logprobs
from lamina.engine.memory import resolve_device, resolve_dtype
from lamina.engine.request import RequestGroup, Sequence
from lamina.engine.runner import ModelRunner
from lamina.engine.sampler import Sampler, needs_history
from lamina.engine.inflight import PENDING, InFlight
from lamina.engine.scheduler import Scheduler, SchedulerOutput
from lamina.engine.startup import StartupTimer
from lamina.engine.stop import apply_stop_strings, check_token_stop
from lamina.outputs import CompletionOutput, RequestOutput
from lamina.sampling_params import SamplingParams

log = logging.getLogger("lamina")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_snapshot_hits: int = 0  # hybrid prefix-cache hits (restored state snapshots), cumulative
    num_prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, cumulative

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        timer = StartupTimer()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config, self.tokenizer, self.model = load_model_and_tokenizer(config, self.dtype, self.device,
                                                                                 progress)
        timer.phase("weights")
        # KV blocks, state slots and snapshots, sized from the state the layers declare and bound into them.
        pools = build_pools(config, self.model, self.model_config, self.dtype, self.device, timer)
        self.state_layout, self.kv_cache = pools.layout, pools.kv_cache
        self.state_pool, self.snapshots = pools.state_pool, pools.snapshots
        self.max_model_len = pools.max_model_len
        bs = config.block_size
        self.allocator = BlockAllocator(self.kv_cache.num_blocks)
        self.prefix_cache = None
        if config.enable_prefix_caching:
            # Recurrent state cannot be rolled back to a prefix: hybrid models hit only where a snapshot is.
            self.prefix_cache = PrefixCache(self.allocator, bs, self.snapshots)
        self.scheduler = Scheduler(self.allocator, bs, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.state_pool.allocator if self.state_pool is not None else None,
                                   self.prefix_cache)
        self.runner = ModelRunner(self.model, bs, self.device)
        self.runner.graphs = build_graphs(config, self.model, self.max_model_len, self.state_pool, self.device)
        if self.runner.graphs is not None:
            timer.phase("graph capture")
        self.eos_token_ids = self._eos_ids()
        self.sampler = Sampler(self.eos_token_ids, config.seed)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.groups: dict[str, RequestGroup] = {}
        self._seq_ids = itertools.count()
        # Streaming callers (the server, chat) want every step's progress; offline batch generation only
        # wants finished requests, which saves building outputs and decoding text on every step.
        self.stream_outputs = True
        self.in_flight: InFlight | None = None  # the launched step whose tokens are not read back yet
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)

    def _eos_ids(self) -> list[int]:
        ids = list(self.model_config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return ids

    # ---- requests -------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give prompt_token_ids")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, (list, tuple)):
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        """Validates and queues a request; raises ValueError (and changes nothing) on bad input."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate(self.model_config.vocab_size)  # ids and top_k against the vocabulary
        text, ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                             "(prompt plus at least one generated token must fit)")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Sequence(next(self._seq_ids), request_id, i, list(ids), len(ids), params, seed, max_tokens,
                           initial_state(len(ids)), logprobs=[] if params.logprobs is not None else None,
                           wants_prompt_logprobs=params.prompt_logprobs is not None and i == 0,
                           prompt_logprobs=[] if params.prompt_logprobs is not None and i == 0 else None)
            seqs.append(seq)
        group = RequestGroup(request_id, text, seqs)
        self.groups[request_id] = group
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return self._output(group)

    def request_ids(self) -> list[str]:
        """Ids of the requests not finished yet (e.g. to abort them all)."""
        return list(self.groups)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def stats(self) -> EngineStats:
        """Requests (not sequences: n > 1 counts once) running and waiting, and the KV pool's state."""
        running = {s.request_id for s in self.scheduler.running}
        waiting = {s.request_id for s in self.scheduler.waiting} - running
        return EngineStats(len(running), len(waiting), self.allocator.num_free,
                           self.allocator.num_blocks,
                           self.prefix_cache.snapshot_hits if self.prefix_cache is not None else 0,
                           self.prefix_cache.queried_tokens if self.prefix_cache is not None else 0)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and launches one forward, then finishes the previous one while the device works.

        Sampled tokens are read back one step late: the next step is built and launched first (its input
        takes the pending tokens straight from the device), so host work overlaps device work. A sequence
        that stopped on the late token wasted one token of compute, which is discarded.
        """
        sched = self.scheduler.schedule()
        touched: dict[str, RequestGroup] = {}
        launched = None
        if sched.scheduled:
            try:
                launched = self._launch(sched)
            except Exception as exc:  # a failure inside the model fails this step's requests, not the engine
                self._fail([s.seq for s in sched.scheduled], exc, touched)
        prev, self.in_flight = self.in_flight, launched
        if prev is not None:
            self._resolve(prev, touched)
        if launched is not None and launched.sync:
            self.in_flight = None
            self._resolve(launched, touched)
        if not touched and launched is None and self.scheduler.waiting and not self.scheduler.running:
            # Cannot happen while every admitted prompt fits the pool; fail loudly rather than spin.
            raise RuntimeError("scheduler made no progress with an empty running set")
        outputs = []
        for rid, group in touched.items():
            finished = group.finished
            if finished or self.stream_outputs:
                outputs.append(self._output(group))
            if finished:
                self.groups.pop(rid, None)
        return outputs

    def _fail(self, seqs: list[Sequence], exc: Exception, touched: dict[str, RequestGroup]) -> None:
        log.error("engine step failed: %s", exc, exc_info=exc)
        for seq in seqs:
            group = self.groups.get(seq.request_id)
            if group is None:
                continue
            group.error = f"{type(exc).__name__}: {exc}"
            for s in group.seqs:
                self.allocator.forget(s.block_table)  # their KV may be garbage: never serve it from cache
                if self.snapshots is not None:
                    self.snapshots.forget(s.block_hashes)
                if not s.finished:
                    s.finish_reason = "error"
                    self.scheduler.finish(s)
            touched[group.request_id] = group

    def _launch(self, sched: SchedulerOutput) -> InFlight:
        prev = self.in_flight
        pending, tokens = None, None
        if prev is not None and prev.draws is not None:
            pending = {seq.seq_id: row for row, (seq, _) in enumerate(prev.sampled)}
            tokens = prev.draws.token_ids
        batch = self.runner.prepare(sched.scheduled, pending, tokens)
        logits = self.runner.execute(batch)
        sampled = [s.seq for s in sched.scheduled if s.sample]
        draws = self.sampler.sample(logits[batch.sample_rows], sampled) if sampled else None
        for item, (row0, nrows) in zip(sched.scheduled, batch.logits_rows):
            seq = item.seq
            if seq.needs_prompt_logprobs():  # rare: reads logits on the host right away
                prompt_logprobs_for_chunk(seq, logits[row0:row0 + nrows], seq.num_computed_tokens,
                                          seq.params.prompt_logprobs, self.detokenizer)
            seq.num_computed_tokens += item.num_tokens
            # Registered now, not when read back: the next step may already reuse these blocks, and the
            # device runs steps in order. Tokens still in flight are never hashed.
            self.scheduler.register_computed(seq, seq.num_tokens - (seq.token_ids[-1] == PENDING))
            self.scheduler.snapshot(seq)  # stream-ordered after this forward (see cache/state_snapshots.py)
        slots = [(seq, seq.num_tokens) for seq in sampled]  # where each sampled token will land
        for seq in sampled:
            seq.token_ids.append(PENDING)
        # Rows whose next sampling reads their history need their token on the host before that.
        sync = not self.async_scheduling or any(needs_history(s) for s in sampled)
        return InFlight(sched.scheduled, slots, draws, sync, draws.start_copy() if draws
                        else None)

    def _resolve(self, flight: InFlight, touched: dict[str, RequestGroup]) -> None:
        for item in flight.scheduled:
            seq = item.seq
            if not seq.finished:
                touched[seq.request_id] = self.groups[seq.request_id]
        for item in flight.scheduled:
            if not item.sample and not item.seq.finished:  # a prompt chunk: its tokens are all known
                self.scheduler.register_computed(item.seq, item.seq.num_tokens)
        if flight.draws is None:
            return
        result = flight.draws.finish_copy(flight.copy)
        now = time.monotonic()
        for row, (seq, idx) in enumerate(flight.sampled):
            if seq.finished:  # aborted, or stopped on an earlier token while this one was in flight
                continue
            token = result.token_ids[row]
            seq.token_ids[idx] = token
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.logprobs is not None:
                seq.logprobs.append(sample_logprobs(result, row, token, self.detokenizer))
                seq.cumulative_logprob += result.chosen_logprobs[row]
            check_token_stop(seq, token, idx + 1 - seq.num_prompt_tokens, self.eos_token_ids, self.max_model_len)
            skip = seq.params.skip_special_tokens
            new = ""
            if self.stream_outputs or seq.params.stop:  # else the text is decoded once, at the end
                new = self.detokenizer.step(seq.detok, seq.token_ids, skip, idx + 1)
            if seq.finish_reason is not None:
                del seq.token_ids[idx + 1:]  # drop a token sampled after the stop
                new += self.detokenizer.flush(seq.detok, seq.token_ids, skip)
            apply_stop_strings(seq, len(new))
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            else:
                self.scheduler.register_computed(seq, idx + 1)

    def _output(self, group: RequestGroup) -> RequestOutput:
        outs = []
        for s in group.seqs:
            ids = s.output_token_ids
            if ids and ids[-1] == PENDING:  # the token of the step still in flight is not known yet
                ids.pop()
            # Copies: a streaming consumer on another thread must not see these lists grow.
            outs.append(CompletionOutput(s.index, s.text, ids, s.cumulative_logprob if s.logprobs is not None
                                         else None, None if s.logprobs is None else list(s.logprobs),
                                         s.finish_reason, s.stop_reason))
        first = group.seqs[0]
        metrics = {"arrival_time": group.arrival_time}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, outs, group.finished,
                             first.prompt_logprobs, first.num_cached_tokens, group.error, metrics)
