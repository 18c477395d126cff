"""The metrics with vLLM's names: the engine core's per-request phases and preemption counts (oracle: the
sequences' own counters and timestamps, and the phases adding up), and their exposition on a real server."""
from __future__ import annotations

import random

import pytest
from server_helpers import MODEL, read_metrics, wait_idle

from lamina import LLM, SamplingParams
from lamina.engine.core import EngineCore
from lamina.engine.ipc import IterationStats
from lamina.server.metrics import ServerMetrics

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_phases_and_preemptions_from_the_core(checkpoints):
    # 40 blocks of 4 tokens cannot hold 16 sequences of up to ~93 tokens: the scheduler must preempt.
    llm = LLM(model=str(checkpoints["llama"]), dtype="float32", device="cpu", block_size=4, progress=False,
              num_kv_blocks=40, max_num_batched_tokens=64)
    core = EngineCore(llm.engine)
    rng = random.Random(0)
    for i in range(16):
        core.add(str(i), {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 70))]},
                 GREEDY)
    seqs = [s for g in llm.engine.groups.values() for s in g.seqs]
    metrics = ServerMetrics(MODEL)
    finished, steps = [], []
    while core.has_work():
        it = IterationStats()
        core.step(it)
        metrics.on_iteration(it, core.stats())
        finished += it.finished
        steps.append(it.num_step_tokens)
    preempted = sum(s.num_preemptions for s in seqs)
    assert preempted > 0 and core.stats().num_preemptions == preempted
    assert sum(f.num_preemptions for f in finished) == preempted and len(finished) == 16
    for f in finished:
        assert min(f.queue_time, f.prefill_time, f.decode_time) >= 0
        assert f.inference_time == pytest.approx(f.prefill_time + f.decode_time, abs=1e-6)
        assert f.queue_time + f.inference_time <= f.e2e_latency + 1e-3
    # Every prompt token and every sampled token went through some step (recomputation after preemption
    # adds more, never less).
    assert sum(steps) >= sum(len(s.prompt_token_ids) + 24 for s in seqs) - 16
    text = metrics.render()[0].decode()
    assert f'lamina:num_preemptions_total{{model_name="{MODEL}"}} {float(preempted)}' in text
    assert f'lamina:request_num_preemptions_sum{{model_name="{MODEL}"}} {float(preempted)}' in text


def test_vllm_named_metrics_on_the_server(client, server):
    before = read_metrics(server.base_url)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, n=2, extra_body={"ignore_eos": True})
    m = wait_idle(server.base_url)
    assert m["lamina:request_params_n_count"] == before["lamina:request_params_n_count"] + 1
    assert m["lamina:request_params_n_sum"] == before["lamina:request_params_n_sum"] + 2
    assert m["lamina:request_params_max_tokens_sum"] == before["lamina:request_params_max_tokens_sum"] + 3
    for phase in ("queue", "prefill", "decode", "inference"):
        assert m[f"lamina:request_{phase}_time_seconds_count"] == before[
            f"lamina:request_{phase}_time_seconds_count"] + 1
    assert m["lamina:iteration_tokens_total_sum"] >= before["lamina:iteration_tokens_total_sum"] + 6
    assert m["lamina:num_preemptions_total"] >= 0 and m["lamina:num_requests_waiting_by_reason"] == 0
    assert m["lamina:cache_config_info"] == 1


def test_generation_tokens_count_only_what_was_emitted(llm_engine):
    """The core counts every token it made, including the ones after a stop string that it made before the
    client's StopSamples reached it; the client's count is what the consumer got (the oracle: the output's
    own token ids, the stop token last)."""
    from lamina.engine.core_client import CoreClient
    from lamina.engine.engine import EngineStats
    from lamina.engine.ipc import CompletionDelta, OutputDelta, StepOutputs

    class Recorder:
        generated = 0

        def on_iteration(self, it, stats) -> None:
            self.generated += it.num_generation_tokens

    tok = llm_engine.tokenizer
    ids = tok("One two three four five six seven eight", add_special_tokens=False).input_ids
    rec = Recorder()
    client = CoreClient(backend=None, observer=rec, tokenizer=tok)
    client._dead = "no core here: StopSamples is not sent"
    client._assembler.start("r", None)
    client._processor.add("r", SamplingParams(n=2, max_tokens=50, stop=[" four"]))

    def step(i: int, new: dict[int, list[int]], first: bool = False) -> None:
        it = IterationStats(num_generation_tokens=sum(len(t) for t in new.values()))  # the core's count
        delta = OutputDelta("r", False, [CompletionDelta(k, t) for k, t in new.items()],
                            prompt_token_ids=[1, 2] if first else None)
        client._on_step(StepOutputs(i, [delta], it, EngineStats(0, 0, 1, 1)))

    step(0, {0: ids[:2], 1: ids[:1]}, first=True)
    step(1, {0: ids[2:5], 1: ids[1:2]})  # sample 0 reaches " four" and one token past it
    step(2, {0: ids[5:7], 1: ids[2:3]})  # the core kept going on sample 0 until the stop arrived
    k = next(n for n in range(1, len(ids) + 1) if " four" in tok.decode(ids[:n]))
    assert k < 5  # the stop token came in step 1, with a token after it
    assert rec.generated == k + 3, (rec.generated, k)  # sample 0 through its stop token, sample 1's three
