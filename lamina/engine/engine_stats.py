"""What an engine reports about itself (LLMEngine.stats): requests, the KV pool, prefix hits, speculation.

Read by the server's metrics, the core process's stats messages and the offline benches."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_snapshot_hits: int = 0  # hybrid prefix-cache hits (restored state snapshots), cumulative
    num_prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, cumulative
    num_step_failures: int = 0  # steps that raised and were retried without the requests that caused it
    # Speculative decoding, cumulative (lamina/spec/decoder.py SpecStats): verify runs, draft tokens verified,
    # drafts accepted, and accepted drafts by position in the run.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] | None = None
    num_preemptions: int = 0  # sequences preempted (blocks freed, recomputed later), cumulative
    # Speculation paused for low acceptance (spec/adaptive.py): sequences paused now, and pauses so far.
    num_spec_paused: int = 0
    num_spec_pauses: int = 0
    # Expert parallelism (parallel/expert_parallel.py): (token, expert) pairs routed to each rank's experts,
    # summed over the MoE layers since start-up (read without a host sync: may lag by a step on CUDA).
    expert_parallel_routed_tokens: list[int] | None = None
    # Speculation off batch-wide for low acceptance across the batch (spec/adaptive.py BatchGate): now, and
    # how many times so far; steps without drafting for disable_by_batch_size.
    spec_batch_paused: bool = False
    num_spec_batch_pauses: int = 0
    num_spec_batch_size_skips: int = 0
    # Steps launched that verified drafts and that sampled without any (cumulative), and times the goodput gate
    # (spec/goodput.py) turned drafting off at a batch size where it did not pay / found it paying.
    num_spec_verify_steps: int = 0
    num_spec_plain_steps: int = 0
    num_spec_goodput_offs: int = 0
    num_spec_goodput_ons: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks


def engine_stats(engine) -> EngineStats:
    """Requests (not sequences: n > 1 counts once) running and waiting, and the KV pool's state."""
    running = {s.request_id for s in engine.scheduler.running}
    waiting = ({s.request_id for s in engine.scheduler.waiting} | engine.structured.held_ids) - running
    spec = engine.spec.stats if engine.spec is not None else None
    return EngineStats(len(running), len(waiting), engine.allocator.num_free,
                       engine.allocator.num_blocks,
                       engine.prefix_cache.snapshot_hits if engine.prefix_cache is not None else 0,
                       engine.prefix_cache.queried_tokens if engine.prefix_cache is not None else 0,
                       engine.num_step_failures, *((spec.num_drafts, spec.num_draft_tokens,
                                                  spec.num_accepted_tokens, list(spec.accepted_per_position))
                                                 if spec is not None else ()),
                       num_preemptions=engine.scheduler.num_preemptions,
                       num_spec_paused=engine.spec.gate.num_paused if engine.spec is not None else 0,
                       num_spec_pauses=engine.spec.gate.num_pauses if engine.spec is not None else 0,
                       spec_batch_paused=engine.spec.batch_paused if engine.spec is not None else False,
                       num_spec_batch_pauses=engine.spec.batch_gate.num_pauses if engine.spec is not None else 0,
                       num_spec_batch_size_skips=engine.spec.num_batch_size_skips if engine.spec is not None else 0,
                       **_spec_steps(engine.spec),
                       expert_parallel_routed_tokens=_routed(engine))


def _spec_steps(spec) -> dict[str, int]:
    if spec is None:
        return {}
    good = spec.goodput
    return {"num_spec_verify_steps": spec.num_verify_steps, "num_spec_plain_steps": spec.num_plain_steps,
            "num_spec_goodput_offs": good.num_offs if good is not None else 0,
            "num_spec_goodput_ons": good.num_ons if good is not None else 0}


def _routed(engine) -> list[int] | None:
    load = getattr(engine, "expert_load", None)
    return load.read() if load is not None else None
