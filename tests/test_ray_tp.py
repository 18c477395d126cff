"""Tensor parallelism with Ray actors (`distributed_executor_backend="ray"`) on a local Ray cluster of two
CPUs: a TP=2 model's greedy output equals TP=1's (the mp backend's oracle, itself checked against HF).

One cluster and one TP=2 engine for the module (starting Ray and an actor costs seconds on 2 cores).
"""
from __future__ import annotations

import time

import pytest
from model_factory import make_checkpoint
from tp_helpers import KW, assert_same
from tp_helpers import PROMPTS as TP_PROMPTS

from lamina import LLM, SamplingParams

ray = pytest.importorskip("ray")

PROMPTS = TP_PROMPTS[:2]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        yield
    finally:
        ray.shutdown()


def test_ray_tp2_matches_tp1(cluster, tmp_path_factory, smol_tokenizer, one_thread):
    path = make_checkpoint(tmp_path_factory.mktemp("ray") / "qwen3", "qwen3", smol_tokenizer, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    one = LLM(str(path), **KW).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="ray", **KW)
    try:
        group = llm.engine.tp
        assert type(group).__name__ == "RayTPGroup" and len(group.actors) == 1
        two = llm.generate(PROMPTS, params, use_tqdm=False)
        for a, b in zip(one, two):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert ea.keys() == eb.keys()
                assert all(abs(ea[t].logprob - eb[t].logprob) < 1e-4 for t in ea)
        group.check()  # the actor is alive
    finally:
        llm.engine.close()
    _assert_bundles_back()


def _assert_bundles_back() -> None:
    """The closed engine's placement group was given back (the next test's needs both CPUs)."""
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU") != 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 2.0


def test_ray_tp2_hybrid_matches_tp1(cluster, tmp_path_factory, smol_tokenizer, one_thread):
    """A hybrid (Qwen3-Next: a recurrent state pool) on Ray actors: each step carries rank 0's state copies
    made outside a forward (RankGroup.attach_state; the Ray group once lacked it and the engine failed to
    start). The second call hits the prefix cache, so a snapshot is copied into a slot before its prefill."""
    from hybrid_helpers import make_hybrid_checkpoint

    path = make_hybrid_checkpoint(tmp_path_factory.mktemp("ray") / "qwen3_next", "qwen3_next", smol_tokenizer,
                                  seed=10)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    one = LLM(str(path), **KW).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="ray", enable_prefix_caching=True,
              state_snapshot_interval=8, **KW)
    try:
        assert_same(one, llm.generate(PROMPTS, params, use_tqdm=False))
        assert_same(one, llm.generate(PROMPTS, params, use_tqdm=False))
        assert llm.engine.stats().num_snapshot_hits > 0
    finally:
        llm.engine.close()
    _assert_bundles_back()


def test_dead_actor_fails_the_stream(cluster, tmp_path_factory, smol_tokenizer, one_thread):
    """An actor killed mid-run: the stream raises ParallelFailure naming the worker, without hanging."""
    from lamina.parallel.context import ParallelFailure

    path = make_checkpoint(tmp_path_factory.mktemp("ray") / "llama", "llama", smol_tokenizer, seed=5)
    llm = LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="ray", **KW)
    try:
        stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        next(stream)
        ray.kill(llm.engine.tp.actors[0])
        t0 = time.monotonic()
        with pytest.raises(ParallelFailure, match="worker 1"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 30
    finally:
        llm.engine.close()


def test_actor_failing_before_the_rendezvous_fails_the_start(cluster):
    """A rank that cannot start (here: a device its node cannot make) fails the start at once, with its
    reason, instead of rank 0 waiting for the store's timeout; its bundles are given back."""
    from types import SimpleNamespace

    import torch

    from lamina.parallel.context import ParallelFailure
    from lamina.parallel.ray_workers import RayTPGroup

    t0 = time.monotonic()
    with pytest.raises(ParallelFailure, match="worker 1 .*before joining"):
        RayTPGroup(SimpleNamespace(tensor_parallel_size=2, device="bogus"), torch.device("cpu"))
    assert time.monotonic() - t0 < 60


def test_backend_is_checked():
    from lamina.config import EngineConfig

    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(model="x", distributed_executor_backend="slurm")
