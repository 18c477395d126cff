"""Prometheus metrics with vLLM-like `lamina:` names, kept in a per-app registry.

The engine core measures every iteration (core.py: token counts and latencies, timed next to the engine) and
sends it with the engine's stats in that step's message; the core client's receiver thread feeds them here
(the observer hook): counters and histograms from the iteration, gauges from the stats. A per-app CollectorRegistry
(not the global one) lets several apps live in one process (tests).
"""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from lamina.engine.engine import EngineStats
from lamina.engine.ipc import IterationStats

# Buckets (seconds) wide enough for a 2-core CPU, where a step under load takes seconds, and fine enough
# for a GPU, where tokens come every few milliseconds.
_TTFT = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
         160.0, 640.0)
_ITL = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
        5.0, 10.0, 20.0, 40.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, labels = self.registry, ["model_name"]
        self._model = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        self.running = gauge("lamina:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("lamina:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("lamina:kv_cache_usage_perc", "Share of KV blocks in use (1 = full).")
        self.free_blocks = gauge("lamina:kv_cache_free_blocks", "KV blocks free in the pool.")
        self.total_blocks = gauge("lamina:kv_cache_total_blocks", "KV blocks in the pool.")
        self.prompt_tokens = Counter("lamina:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.prefix_hits = Counter("lamina:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                                   labels, registry=r)
        self.snapshot_hits = Counter("lamina:prefix_cache_snapshot_hits",
                                     "Hybrid models: prefix hits served by restoring a recurrent-state snapshot.",
                                     labels, registry=r)
        self._snapshot_hits_seen = 0  # the engine keeps a running total; the counter gets the increments
        self.prefix_queries = Counter("lamina:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", labels, registry=r)
        self._prefix_queries_seen = 0
        self.generation_tokens = Counter("lamina:generation_tokens", "Tokens generated.", labels, registry=r)
        self.request_success = Counter("lamina:request_success", "Requests finished, by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.step_failures = Counter("lamina:engine_step_failures",
                                     "Engine steps that raised (retried without the culprit, or the iteration "
                                     "failed).", labels, registry=r)
        self._step_failures_seen = 0  # EngineStats.num_step_failures is a running total
        # Speculative decoding (running totals in EngineStats; the counters take the increments).
        self.spec_drafts = Counter("lamina:spec_decode_num_drafts", "Verify runs (one per sequence and step with "
                                   "drafts).", labels, registry=r)
        self.spec_draft_tokens = Counter("lamina:spec_decode_num_draft_tokens", "Draft tokens verified.", labels,
                                         registry=r)
        self.spec_accepted = Counter("lamina:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
                                     registry=r)
        self.spec_accepted_pos = Counter("lamina:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the run.", labels + ["position"],
                                         registry=r)
        self.spec_paused = Gauge("lamina:spec_decode_num_paused_seqs", "Sequences whose drafting is paused for "
                                 "low acceptance (probed again later).", labels, registry=r)
        self.spec_pauses = Counter("lamina:spec_decode_num_pauses", "Times a sequence's drafting was paused for "
                                   "low acceptance.", labels, registry=r)
        self.spec_batch_paused = Gauge("lamina:spec_decode_batch_paused", "1 while speculation is off batch-wide "
                                       "for low acceptance across the batch (probed again later).", labels,
                                       registry=r)
        self.spec_batch_pauses = Counter("lamina:spec_decode_num_batch_pauses", "Times speculation turned off "
                                         "batch-wide for low acceptance.", labels, registry=r)
        self.spec_verify_steps = Counter("lamina:spec_decode_num_verify_steps", "Engine steps that verified "
                                         "drafts.", labels, registry=r)
        self.spec_plain_steps = Counter("lamina:spec_decode_num_plain_steps", "Engine steps that decoded without "
                                        "verifying any draft (speculation off or nothing proposed).", labels,
                                        registry=r)
        self.spec_goodput_offs = Counter("lamina:spec_decode_num_goodput_offs", "Times drafting turned off at a "
                                         "batch size where it did not beat plain decoding's tokens/s.", labels,
                                         registry=r)
        self._spec_seen = [0] * 8
        self._spec_pos_seen: list[int] = []
        self.ep_routed = Counter("lamina:expert_parallel_routed_tokens", "(token, expert) pairs routed to each "
                                 "expert-parallel rank's experts, summed over MoE layers.", labels + ["rank"],
                                 registry=r)
        self._ep_seen: list[int] = []
        self.http_errors = Counter("lamina:http_errors", "Error responses sent, by status code.",
                                   labels + ["status"], registry=r)
        self.ttft = Histogram("lamina:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_TTFT, registry=r)
        self.itl = Histogram("lamina:inter_token_latency_seconds", "Time between tokens of a sequence.", labels,
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("lamina:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=_E2E, registry=r)
        self.prompt_len = Histogram("lamina:request_prompt_tokens", "Prompt length of finished requests.",
                                    labels, buckets=_token_buckets(), registry=r)
        self.gen_len = Histogram("lamina:request_generation_tokens", "Tokens generated by finished requests.",
                                 labels, buckets=_token_buckets(), registry=r)
        # vLLM's names for the rest of what it exports (phases of finished requests, scheduler numbers).
        self.preemptions = Counter("lamina:num_preemptions", "Sequences preempted (blocks freed, recomputed "
                                   "later).", labels, registry=r)
        self._preemptions_seen = 0  # EngineStats.num_preemptions is a running total
        self.iteration_tokens = Histogram("lamina:iteration_tokens_total", "Tokens scheduled per engine step.",
                                          labels, buckets=_STEP_TOKENS, registry=r)

        def phase(name: str, doc: str) -> Histogram:
            return Histogram(f"lamina:request_{name}_time_seconds", doc, labels, buckets=_E2E, registry=r)

        self.queue_time = phase("queue", "Arrival to first scheduled.")
        self.prefill_time = phase("prefill", "First scheduled to first token.")
        self.decode_time = phase("decode", "First token to finish.")
        self.inference_time = phase("inference", "First scheduled to finish.")
        self.params_n = Histogram("lamina:request_params_n", "The n of requests (samples per prompt).", labels,
                                  buckets=(1, 2, 5, 10, 20), registry=r)
        self.params_max_tokens = Histogram("lamina:request_params_max_tokens", "The max_tokens of requests.",
                                           labels, buckets=_token_buckets(), registry=r)
        self.req_preemptions = Histogram("lamina:request_num_preemptions", "Preemptions of finished requests.",
                                         labels, buckets=(0, 1, 2, 5, 10, 20), registry=r)
        self.waiting_by_reason = Gauge("lamina:num_requests_waiting_by_reason", "Waiting requests by why they "
                                       "wait: capacity (KV blocks, batch size) or deferred (not ready to run).",
                                       labels + ["reason"], registry=r)
        self.cache_config = Gauge("lamina:cache_config_info", "The KV cache's configuration (labels; value 1).",
                                  labels + ["block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=r)

        # Children exist from the start, so every series reads 0 before its first event (not absent).
        for metric in (self.running, self.waiting, self.kv_usage, self.free_blocks, self.total_blocks,
                       self.prompt_tokens, self.prefix_hits, self.prefix_queries, self.snapshot_hits,
                       self.generation_tokens, self.spec_drafts, self.spec_draft_tokens, self.spec_accepted,
                       self.step_failures, self.ttft, self.itl, self.e2e, self.prompt_len, self.gen_len,
                       self.preemptions, self.iteration_tokens, self.queue_time, self.prefill_time, self.decode_time,
                       self.inference_time, self.params_n, self.params_max_tokens, self.req_preemptions):
            metric.labels(model_name)
        for reason in ("capacity", "deferred"):
            self.waiting_by_reason.labels(model_name, reason)
        for reason in ("stop", "length", "error"):
            self.request_success.labels(model_name, reason)

    def on_iteration(self, it: IterationStats, stats: EngineStats) -> None:
        """Called on the core client's receiver thread (prometheus_client metrics are thread-safe)."""
        m = self._model
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.free_blocks.labels(m).set(stats.num_free_blocks)
        self.total_blocks.labels(m).set(stats.num_total_blocks)
        # Every waiting request here waits for room; nothing defers requests yet (no grammar compiles waited on).
        self.waiting_by_reason.labels(m, "capacity").set(stats.num_waiting)
        if stats.num_preemptions > self._preemptions_seen:
            self.preemptions.labels(m).inc(stats.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.num_preemptions
        if it.num_step_tokens:
            self.iteration_tokens.labels(m).observe(it.num_step_tokens)
        if it.num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(it.num_prompt_tokens)
        if it.num_cached_prompt_tokens:
            self.prefix_hits.labels(m).inc(it.num_cached_prompt_tokens)
        if stats.num_snapshot_hits > self._snapshot_hits_seen:
            self.snapshot_hits.labels(m).inc(stats.num_snapshot_hits - self._snapshot_hits_seen)
            self._snapshot_hits_seen = stats.num_snapshot_hits
        if stats.num_prefix_queried_tokens > self._prefix_queries_seen:
            self.prefix_queries.labels(m).inc(stats.num_prefix_queried_tokens - self._prefix_queries_seen)
            self._prefix_queries_seen = stats.num_prefix_queried_tokens
        if it.num_generation_tokens:
            self.generation_tokens.labels(m).inc(it.num_generation_tokens)
        if it.step_failed:
            self.step_failures.labels(m).inc()
        if stats.num_step_failures > self._step_failures_seen:
            self.step_failures.labels(m).inc(stats.num_step_failures - self._step_failures_seen)
            self._step_failures_seen = stats.num_step_failures
        self._spec(stats)
        self._expert_load(stats)
        for v in it.time_to_first_tokens:
            self.ttft.labels(m).observe(v)
        for v in it.inter_token_latencies:
            self.itl.labels(m).observe(v)
        for f in it.finished:
            self.request_success.labels(m, f.finish_reason).inc()
            self.e2e.labels(m).observe(f.e2e_latency)
            self.prompt_len.labels(m).observe(f.num_prompt_tokens)
            self.gen_len.labels(m).observe(f.num_generation_tokens)
            self.req_preemptions.labels(m).observe(f.num_preemptions)
            for hist, v in ((self.queue_time, f.queue_time), (self.prefill_time, f.prefill_time),
                            (self.decode_time, f.decode_time), (self.inference_time, f.inference_time)):
                if v is not None:
                    hist.labels(m).observe(v)

    def _expert_load(self, stats: EngineStats) -> None:
        routed = stats.expert_parallel_routed_tokens
        if not routed:
            return
        seen = self._ep_seen or [0] * len(routed)
        for rank, (now, before) in enumerate(zip(routed, seen)):
            if now > before:
                self.ep_routed.labels(self._model, str(rank)).inc(now - before)
        self._ep_seen = list(routed)

    def on_request(self, n: int, max_tokens: int | None) -> None:
        """A request the server added to the engine (its parameters, as vLLM's request_params_*)."""
        self.params_n.labels(self._model).observe(n)
        if max_tokens is not None:
            self.params_max_tokens.labels(self._model).observe(max_tokens)

    def set_cache_config(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        self.cache_config.labels(self._model, str(block_size), str(num_blocks), str(prefix_caching)).set(1)

    def _spec(self, stats: EngineStats) -> None:
        m = self._model
        totals = [stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens,
                  stats.num_spec_pauses, stats.num_spec_batch_pauses, stats.num_spec_verify_steps,
                  stats.num_spec_plain_steps, stats.num_spec_goodput_offs]
        self.spec_paused.labels(m).set(stats.num_spec_paused)
        self.spec_batch_paused.labels(m).set(int(stats.spec_batch_paused))
        for i, counter in enumerate((self.spec_drafts, self.spec_draft_tokens, self.spec_accepted, self.spec_pauses,
                                     self.spec_batch_pauses, self.spec_verify_steps, self.spec_plain_steps,
                                     self.spec_goodput_offs)):
            if totals[i] > self._spec_seen[i]:
                counter.labels(m).inc(totals[i] - self._spec_seen[i])
                self._spec_seen[i] = totals[i]
        per_pos = stats.spec_accepted_per_position or []
        if len(self._spec_pos_seen) < len(per_pos):
            self._spec_pos_seen += [0] * (len(per_pos) - len(self._spec_pos_seen))
        for j, total in enumerate(per_pos):
            if total > self._spec_pos_seen[j] or not self._spec_pos_seen[j]:
                self.spec_accepted_pos.labels(m, str(j)).inc(total - self._spec_pos_seen[j])
                self._spec_pos_seen[j] = total

    def on_http_error(self, status: int) -> None:
        self.http_errors.labels(self._model, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _token_buckets() -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to 100k tokens."""
    out = []
    for exp in range(6):
        out += [m * 10**exp for m in (1, 2, 5)]
    return [float(x) for x in out]
