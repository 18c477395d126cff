"""LLMEngine: requests in, one scheduled forward per step, token ids out.

Text (detokenization, stop strings, logprob token strings) is made on the output side
(engine/output_processor.py), off the step loop; `finish_sample` is how that side ends a sample at a stop
string.

Every exit path of a sequence (finish, abort, error) goes through Scheduler.finish, which returns its
blocks; preemption returns them too and the sequence is recomputed later. Reading a step back (tokens into
sequences, verify steps' accepted drafts, request outputs) is engine/readback.py.
"""
from __future__ import annotations

import itertools
import logging
import weakref

from lamina.cache.block_allocator import BlockAllocator
from lamina.cache.prefix_cache import PrefixCache
from lamina.cache.sliding_window import release_horizon
from lamina.config import EngineConfig
from lamina.engine.build import build_graphs, build_pools, build_window_group, load_model_and_tokenizer
from lamina.engine.detokenizer import DeferredTokenText, initial_state
from lamina.engine.engine_stats import EngineStats, engine_stats
from lamina.engine.inflight import PENDING, InFlight
from lamina.engine.isolation import StepIsolation
from lamina.engine.logprobs import prompt_logprobs_for_chunk
from lamina.engine.memory import resolve_device, resolve_dtype
from lamina.engine.readback import StepReadback
from lamina.engine.request import RequestGroup, Sequence
from lamina.engine.runner import ModelRunner
from lamina.engine.sampler import Sampler
from lamina.engine.scheduler import ScheduledSeq, Scheduler
from lamina.engine.startup import StartupTimer
from lamina.engine.warmup import warm_up
from lamina.outputs import RequestOutput
from lamina.parallel.context import ParallelFailure
from lamina.parallel.expert_parallel import expert_load
from lamina.parallel.workers import start_tensor_parallel
from lamina.sampling_params import SamplingParams
from lamina.spec.accept import accepted_on_device
from lamina.spec.build import build_spec_decoder, load_spec_weights
from lamina.structured.manager import StructuredOutputManager, sampled_rows

log = logging.getLogger("lamina")


class LLMEngine(StepReadback, StepIsolation):
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # Tensor parallelism: rank 0 is this process; its workers start first and load their slices meanwhile.
        self.tp = start_tensor_parallel(config, self.device)  # None: one process, no collectives
        try:
            self._start(config, progress)
        except BaseException:
            if self.tp is not None:
                self.tp.shutdown()
            raise
        self._close = weakref.finalize(self, self.tp.shutdown) if self.tp is not None else None

    def close(self) -> None:
        """Stops the tensor-parallel workers (nothing to do for one process); the engine cannot step after."""
        if self._close is not None:
            self._close()

    def _start(self, config: EngineConfig, progress: bool) -> None:
        timer = StartupTimer()
        parallel = self.tp.ctx if self.tp is not None else None
        self.model_config, self.tokenizer, self.model = load_model_and_tokenizer(config, self.dtype, self.device,
                                                                                 progress, parallel)
        # A proposer's own weights (the mtp head) load now, so the KV pool's budget below sees them.
        self.spec_weights = load_spec_weights(config.speculative_config, self)
        timer.phase("weights")
        # KV blocks, state slots and snapshots, sized from the state the layers declare and bound into them.
        pools = build_pools(config, self.model, self.model_config, self.dtype, self.device, timer,
                            getattr(self.spec_weights, "kv_layers", None), parallel)
        self.state_layout, self.kv_cache = pools.layout, pools.kv_cache
        self.state_pool, self.snapshots = pools.state_pool, pools.snapshots
        self.max_model_len = pools.max_model_len
        bs = config.block_size
        # Sliding-window-only models free the blocks that fall out of the window (cache/sliding_window.py).
        window = release_horizon(self.state_layout.kv_specs)
        self.allocator = BlockAllocator(self.kv_cache.num_blocks, reserve_null=window is not None)
        # Sliding-window layers next to full ones keep only their window's blocks, in a pool of their own.
        self.window_group = build_window_group(self.state_layout, self.kv_cache, bs)
        self.prefix_cache = None
        if config.enable_prefix_caching:
            # Recurrent state cannot be rolled back to a prefix: hybrid models hit only where a snapshot is.
            self.prefix_cache = PrefixCache(self.allocator, bs, self.snapshots, window, self.window_group)
        self.scheduler = Scheduler(self.allocator, bs, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.state_pool.allocator if self.state_pool is not None else None,
                                   self.prefix_cache, window, self.window_group)
        self.runner = ModelRunner(self.model, bs, self.device)
        if self.tp is not None:  # every step's inputs (and the graph to replay) go to the workers first
            self.runner.step_sink = self.tp.send_step
            if self.state_pool is not None:  # and the state pool's copies outside a forward follow them
                self.tp.attach_state(self.state_pool)
        # Under tensor parallelism every worker captures the same graphs at this point (collectively).
        self.runner.graphs = build_graphs(config, self.model, self.max_model_len, self.state_pool, self.device,
                                          strict=self.tp is not None)
        if self.runner.graphs is not None:
            timer.phase("graph capture")
        self.eos_token_ids = self._eos_ids()
        self.sampler = Sampler(self.eos_token_ids, config.seed)
        self.detokenizer = DeferredTokenText()  # logprob entries' decoded_token: filled on the output side
        self.spec = build_spec_decoder(config.speculative_config, self)  # None without speculative decoding
        # Grammars (compiled off the step loop) and the host-side token masks of constrained rows.
        self.structured = StructuredOutputManager(self.tokenizer, self.runner.vocab or self.model_config.vocab_size,
                                                  self.eos_token_ids, self.device)
        self.groups: dict[str, RequestGroup] = {}
        self._seq_ids = itertools.count()
        # Streaming callers (the server, chat) want every step's progress; offline batch generation only
        # wants finished requests (and those with stop strings, which the output side matches as they grow).
        self.stream_outputs = True
        self.in_flight: InFlight | None = None  # the launched step whose tokens are not read back yet
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        if self.device.type == "cuda" if config.warmup is None else config.warmup:
            warm_up(self)
            timer.phase("warm-up")
        # Expert parallelism's per-rank routing counts (rank 0 counts every rank's): from zero after warm-up.
        self.expert_load = expert_load(self.model)
        if self.expert_load is not None:
            self.expert_load.reset()

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
            bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)][:1]
            if bad:
                raise ValueError(f"prompt token id {bad[0]!r} is out of vocabulary: prompt token ids must be integers "
                                 f"in [0, {vocab})")
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams) -> None:
        """Validates and queues a request; raises ValueError (and changes nothing) on bad input."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate(self.model_config.vocab_size)  # ids and top_k against the vocabulary
        self.structured.prepare(params)  # a bad schema, regex or grammar fails here (400)
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
        if self.structured.hold(group):  # scheduled once its grammar is compiled (see _admit_held)
            return
        for seq in seqs:
            self.scheduler.add(seq)

    def _admit_held(self, touched: dict[str, RequestGroup]) -> None:
        """Schedules the requests whose grammars finished compiling (fails those that could not compile)."""
        idle = not self.scheduler.running and not self.scheduler.waiting and self.in_flight is None
        for group, error in self.structured.ready(idle):
            if group.request_id not in self.groups:
                continue
            if error is not None:
                group.error = error
                for seq in group.seqs:
                    seq.finish_reason = "error"
                    self.scheduler.finish(seq)
                touched[group.request_id] = group
                continue
            for seq in group.seqs:
                self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self.structured.discard(request_id)
        for seq in group.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return self._output(group)

    def finish_sample(self, request_id: str, index: int, num_tokens: int, stop: str) -> RequestOutput | None:
        """Ends sample `index` of a request after its first `num_tokens` output tokens, on a stop string the
        output side found: later tokens (and their logprobs) are dropped and its blocks are freed now. Returns
        the request's output (finished once all its samples are); None for an unknown request or a sample
        that had already ended."""
        group = self.groups.get(request_id)
        if group is None or not 0 <= index < len(group.seqs) or group.seqs[index].finished:
            return None
        seq = group.seqs[index]
        keep = seq.num_prompt_tokens + max(0, num_tokens)
        del seq.token_ids[keep:]  # with a token still in flight: the finished sequence is skipped when read back
        if seq.logprobs is not None:
            del seq.logprobs[keep - seq.num_prompt_tokens:]
            seq.cumulative_logprob = 0.0
            for token, entry in zip(seq.output_token_ids, seq.logprobs):
                seq.cumulative_logprob += entry[token].logprob
        seq.finish_reason, seq.stop_reason = "stop", stop
        self.scheduler.finish(seq)
        out = self._output(group)
        if group.finished:
            self.groups.pop(request_id, None)
        return out

    def request_ids(self) -> list[str]:
        """Ids of the requests not finished yet (e.g. to abort them all)."""
        return list(self.groups)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def stats(self) -> EngineStats:
        """Requests (not sequences: n > 1 counts once) running and waiting, and the KV pool's state."""
        return engine_stats(self)

    # ---- the step -------------------------------------------------------------------------------
    num_step_failures = 0  # steps whose forward or sampling raised (each retried without its culprit)

    def step(self) -> list[RequestOutput]:
        """Schedules and launches one forward, then finishes the previous one while the device works.

        Sampled tokens are read back one step late: the next step is built and launched first (its input
        takes the pending tokens straight from the device), so host work overlaps device work. A sequence
        that stopped on the late token wasted one token of compute, which is discarded. A step the next one's
        inputs depend on (`InFlight.sync`: verify steps, and steps whose sequences draft next) is read back at
        the start of the next call instead, before that step is built (at once without async scheduling): what
        does not change the next step's inputs (outputs, the gate's timing, the caller's output handling) then
        runs while the device computes the step, not between its read-back and the next launch.
        """
        touched: dict[str, RequestGroup] = {}
        self._admit_held(touched)
        late: list | None = None
        if self.in_flight is not None and self.in_flight.sync:
            # (the docstring's sync step; its prefix-cache registration, `late`, waits until after this launch)
            prev, self.in_flight, late = self.in_flight, None, []
            self._resolve(prev, touched, late)
        if self.spec is not None:  # drafts for the sequences about to decode (the scheduler budgets them)
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        launched = None
        if sched.scheduled:
            try:
                launched = self._launch(sched.scheduled, touched)
            except ParallelFailure as exc:  # the model itself is gone: nothing to isolate, the engine has failed
                if self.tp is not None:
                    raise self.tp.fail(exc) from exc
                raise
            except Exception as exc:  # one request's failure must not fail the others: isolate it
                self.num_step_failures += 1
                if self.state_pool is not None:
                    # A forward that got far enough has already advanced the recurrent states in place, so
                    # re-running it would compute from the wrong state: fail the step's requests instead.
                    self._fail([s.seq for s in sched.scheduled], exc, touched)
                else:  # KV stores are idempotent: the same step can run again
                    prev, self.in_flight = self.in_flight, None
                    if prev is not None:
                        self._resolve(prev, touched)
                    self._isolate([s for s in sched.scheduled if not s.seq.finished], exc, touched)
        prev, self.in_flight = self.in_flight, launched
        if late:
            self._register_late(late)
        if prev is not None:
            self._resolve(prev, touched)
        if launched is not None and launched.sync and not self.async_scheduling:
            self.in_flight = None
            self._resolve(launched, touched)
        if self.spec is not None:  # a proposer's own state of sequences that ended this step goes back now
            self.spec.after_step()
        if not touched and launched is None and self.scheduler.waiting and not self.scheduler.running:
            # Cannot happen while every admitted prompt fits the pool; fail loudly rather than spin.
            raise RuntimeError("scheduler made no progress with an empty running set")
        outputs = []
        for rid, group in touched.items():
            finished = group.finished
            if finished or self.stream_outputs or group.seqs[0].params.stop:
                outputs.append(self._output(group))
            if finished:
                self.groups.pop(rid, None)
        return outputs

    def _launch(self, scheduled: list[ScheduledSeq],
                touched: dict[str, RequestGroup] | None = None) -> InFlight | None:
        """Builds, runs and samples one step. Raises before changing any sequence if the batch, the
        forward or the sampler fails (so the step can be retried); then commits the step's bookkeeping.
        None: a constrained step read the step in flight back first, and its tokens ended every sequence."""
        prev = self.in_flight
        constrained = self.structured.constrains([s.seq for s in scheduled if s.num_sampled])
        fill, filling = None, False
        if constrained:  # the mask depends on the tokens of the step in flight (structured/fill.py)
            if prev is not None and prev.ready():  # on the host already: read back now, at no wait, so the
                # mask fills on the filler's threads while this step is built and its forward runs
                self.in_flight = None
                self._resolve(prev, touched if touched is not None else {})
                prev = None
                scheduled = [s for s in scheduled if not s.seq.finished]  # those its tokens stopped
                if not scheduled:
                    return None
            if prev is None:
                fill, filling = self.structured.start_bitmask(*sampled_rows(scheduled)), True
        try:
            pending = prev.pending() if prev is not None else None
            batch = self.runner.prepare(scheduled, pending)
            logits = self.runner.execute(batch)
            # the sampler's arrays are built and copied while the forward runs (runner.py says why)
            self.runner.ship_sampling(batch, self.sampler, pending)
        except BaseException:
            if fill is not None:  # its threads hold the matchers: wait for them before anyone retries
                fill.cancel()
            raise
        draws = None
        if batch.sampled:
            mask = None
            if constrained:
                if not filling:
                    # Not on the host yet: read them back now, while this forward runs (its inputs already
                    # took them on the device), then fill the mask here.
                    self.in_flight = None
                    self._resolve(prev, touched if touched is not None else {})
                    fill = self.structured.start_bitmask(batch.sampled, batch.offsets, background=False)
                mask = fill.result() if fill is not None else None
            draws = self.sampler.sample(batch.sampled_logits(logits), batch.sampled, batch.sampling, batch.offsets,
                                        bitmask=mask.bitmask if mask is not None else None,
                                        bitmask_rows=mask.rows if mask is not None else None)
        for i, item in enumerate(scheduled):
            seq = item.seq
            if seq.needs_prompt_logprobs():  # rare: reads logits on the host right away (idempotent on retry)
                row0, nrows = int(batch.logits_start[i]), int(batch.num_logits[i])
                prompt_logprobs_for_chunk(seq, logits[row0:row0 + nrows], seq.num_computed_tokens,
                                          seq.params.prompt_logprobs, self.detokenizer)
        if self.spec is not None:  # a proposer drafting from the target's hidden states takes them here
            self.spec.observe(scheduled, self.runner.last_hidden)
        return self._commit(scheduled, draws)

    def _commit(self, scheduled: list[ScheduledSeq], draws) -> InFlight:
        sampled = []
        for item in scheduled:
            seq = item.seq
            if seq.finished:  # stopped by the step read back early (see _launch): its rows are discarded
                if item.num_sampled:
                    sampled.append((seq, seq.num_tokens, item.num_sampled))
                continue
            seq.num_computed_tokens += item.num_tokens
            # Registered now, not when read back: the next step may already reuse these blocks, and the
            # device runs steps in order. Tokens still in flight are never hashed.
            self.scheduler.register_computed(seq, seq.num_tokens - (seq.token_ids[-1] == PENDING))
            self.scheduler.snapshot(seq)  # stream-ordered after this forward (see cache/state_snapshots.py)
            if item.num_sampled:
                # Its rows' first token lands here; the rows after it verify drafts, so how many more tokens
                # it gets is known only when read back.
                sampled.append((seq, seq.num_tokens, item.num_sampled))
                seq.token_ids.append(PENDING)
        # A verify step must be read back before the sequence's next positions are known, and so must a step
        # whose sequences may draft next (drafts follow the last token); a step where speculation is paused
        # for all of them overlaps as without it. (Penalties need no sync: the next step's sampler reads a
        # history token still in flight from these draws.)
        verify = any(n > 1 for _, _, n in sampled)
        sync = (not self.async_scheduling or verify
                or (self.spec is not None and self.spec.drafts_next([s for s, _, _ in sampled])))
        gate_sample = None
        if self.spec is not None and sampled:
            self.spec.count_step(verify)
            gate_sample = self.spec.gate_sample(scheduled, len(sampled), verify, sync and self.async_scheduling)
        accepted = None
        if verify:
            forced = self.spec.forced_counts(sampled) if self.spec is not None else None
            accepted = accepted_on_device(draws.token_ids, sampled, forced)
            if accepted.device.type == "cuda":  # to the host with the draws (their copy's event is recorded
                accepted = accepted.to("cpu", non_blocking=True)  # after it): no second sync to read it back
        return InFlight(scheduled, sampled, draws, sync, draws.start_copy() if draws is not None else None,
                        accepted, gate_sample)
