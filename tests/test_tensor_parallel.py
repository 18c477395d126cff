"""Tensor parallelism on the CPU: two gloo processes must produce what one process produces.

Oracle: the same engine at tensor_parallel_size 1 (itself checked against HF transformers by
test_parity_hf.py), fp32: greedy tokens identical, logprobs within 1e-4. Each TP=2 engine costs one worker
start (a fresh interpreter), so the engines are shared per module and the prompts are few and short.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from model_factory import make_checkpoint
from tp_helpers import KW, PROMPTS, assert_same, load_experts, tp_pair

from lamina import LLM, SamplingParams
from lamina.config import EngineConfig
from lamina.parallel.context import ParallelContext, ParallelFailure


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smol_tokenizer, one_thread):
    """qwen3 (q/k norms, 4 query heads over 2 KV heads: one KV head per rank), TP=1 vs TP=2."""
    path = make_checkpoint(tmp_path_factory.mktemp("tp") / "qwen3", "qwen3", smol_tokenizer, seed=3)
    one, two, llm = tp_pair(path)
    yield one, two, llm
    llm.engine.close()


def test_dense_tp2_matches_tp1(qwen3):
    one, two, _ = qwen3
    assert_same(one, two)


def test_rank0_holds_its_slice(qwen3):
    """Rank 0's KV pool holds its KV head only; its weights are its slices; the runner sees the full vocab."""
    _, _, llm = qwen3
    eng = llm.engine
    attn = eng.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert eng.kv_cache.views[0].k.shape[2] == 1  # [blocks, block_size, local KV heads, head dim]
    qkv = attn.qkv_proj.weight
    assert qkv.shape == ((2 + 1 + 1) * 32, 64)
    assert eng.model.lm_head.weight.shape[0] == eng.model_config.vocab_size // 2
    assert eng.runner.vocab == eng.model_config.vocab_size
    assert eng.allocator.num_free == eng.allocator.num_blocks  # every lease came back


def test_preemption_under_tp(qwen3):
    """A pool too small for the batch: rank 0 preempts and recomputes; the workers only follow the steps."""
    _, _, llm = qwen3
    prompts = [[p + i for p in PROMPTS[0]] for i in range(6)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    two = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    one = LLM(llm.engine.config.model, **KW).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in two]
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_replicated_kv_heads_tied_vocab(tmp_path_factory, smol_tokenizer, one_thread):
    """qwen2: one KV head for two ranks (replicated), qkv bias, lm_head tied to the vocab-parallel embedding."""
    path = make_checkpoint(tmp_path_factory.mktemp("tp") / "qwen2", "qwen2", smol_tokenizer, seed=4,
                           num_key_value_heads=1)
    one, two, llm = tp_pair(path)
    try:
        assert_same(one, two)
        m = llm.engine.model
        assert m.lm_head.weight is m.model.embed_tokens.weight
        assert m.model.layers[0].self_attn.num_kv_heads == 1
    finally:
        llm.engine.close()


def test_moe_tp2_matches_tp1(tmp_path_factory, smol_tokenizer, one_thread):
    """qwen3_moe: routed experts split along their intermediate dim, router replicated; one dense layer too."""
    from hybrid_helpers import make_hybrid_checkpoint

    path = make_hybrid_checkpoint(tmp_path_factory.mktemp("tp") / "qwen3_moe", "qwen3_moe", smol_tokenizer, seed=6)
    one, two, llm = tp_pair(path)
    try:
        assert_same(one, two)
        experts = llm.engine.model.model.layers[0].mlp.experts
        assert tuple(experts.gate_up_proj.shape) == (4, 32, 64) and tuple(experts.down_proj.shape) == (4, 64, 16)
    finally:
        llm.engine.close()


def test_single_process_path_unchanged(checkpoints, one_thread):
    import torch.distributed as dist

    llm = LLM(str(checkpoints["qwen3"]), **KW)
    assert llm.engine.tp is None and llm.engine.runner.step_sink is None
    assert not (dist.is_available() and dist.is_initialized())
    assert type(llm.engine.model.lm_head.format).__name__ == "DenseFormat"


def test_dead_worker_fails_requests_and_the_engine(tmp_path_factory, smol_tokenizer, one_thread):
    """A worker killed mid-run: the stream raises ParallelFailure naming it (no hang), and so does every later
    call; the core's contained step re-raises it (the server's core process exits: /health turns 503)."""
    from lamina.engine.core import EngineCore
    from lamina.engine.ipc import IterationStats

    path = make_checkpoint(tmp_path_factory.mktemp("tp") / "llama", "llama", smol_tokenizer, seed=5)
    llm = LLM(str(path), tensor_parallel_size=2, **KW)
    try:
        worker = llm.engine.tp.procs[0]
        stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        next(stream)
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ParallelFailure, match="worker 1 .* exited"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 30
        with pytest.raises(ParallelFailure, match="worker 1"):
            llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2), use_tqdm=False)
        core = EngineCore(llm.engine)
        core.add("r", PROMPTS[1], SamplingParams(max_tokens=2))
        with pytest.raises(ParallelFailure):
            core.step(IterationStats(), contain_failures=True)
    finally:
        llm.engine.close()


def test_bad_sizes_refused_at_start(checkpoints):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"the model's attention heads \(4\) does not divide by 3") as info:
        LLM(str(checkpoints["llama"]), tensor_parallel_size=3, **KW)
    assert "\n" not in str(info.value) and time.monotonic() - t0 < 10  # refused before any worker starts


def test_unsupported_settings_refused(checkpoints):
    with pytest.raises(ValueError, match="speculative decoding method 'self_spec'"):  # ngram is supported
        LLM(str(checkpoints["llama"]), tensor_parallel_size=2,
            speculative_config={"method": "self_spec", "num_speculative_tokens": 2}, **KW)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(model="x", tensor_parallel_size=0)


def test_more_ranks_than_gpus_refused(monkeypatch):
    from lamina.parallel import workers

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs, this host has 1"):
        workers.check_devices(torch.device("cuda"), 2)
    with pytest.raises(ValueError, match="give --device cuda, not cuda:1"):
        workers.check_devices(torch.device("cuda", 1), 2)


def test_unsupported_layer_kinds_refused():
    from lamina.models.config import LayerSpec, ModelConfig
    from lamina.parallel.tp_plan import check_tp_config

    cfg = ModelConfig("nemotron_h", 64, 16, 32, 4, 2, 4, [LayerSpec("attention", "relu2_moe")])
    with pytest.raises(ValueError, match="does not split relu2_moe layers yet"):
        check_tp_config(cfg, 2)
    cfg = ModelConfig("llama", 64, 16, 32, 6, 3, 4, [LayerSpec()])
    with pytest.raises(ValueError, match="3 KV heads neither divide by 2 nor divide it"):
        check_tp_config(cfg, 2)


def test_cli_flag():
    from lamina.args import CliParser, add_engine_args, engine_kwargs

    p = CliParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "m", "--tensor-parallel-size", "2"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 2


def test_formats_load_their_rank_slice():
    """Rank 1 of 2, no process group needed to load: each fused part split on its own, KV replicated when
    fewer heads than ranks, row-parallel columns; a wrong full shape is refused with the checkpoint's size."""
    from lamina.models.layers.linear import Linear
    from lamina.models.weight_formats import Partition, weight_loader
    from lamina.parallel.tp_formats import ColumnParallel, RowParallel

    ctx = ParallelContext(1, 2)
    q, k = torch.randn(8, 6), torch.randn(2, 6)
    qkv = Linear(6, {"q": 8, "k": 2, "v": 2}, fmt=ColumnParallel(ctx))
    load = weight_loader(qkv, "weight")
    load(qkv.weight, q, "q")
    load(qkv.weight, k, "k")
    load(qkv.weight, -k, "v")
    assert torch.equal(qkv.weight, torch.cat([q[4:], k[1:], -k[1:]]))
    one_kv = Linear(6, {"q": 8, "k": 2}, fmt=ColumnParallel(ctx, {"k": Partition(0, 1, 0)}))
    weight_loader(one_kv, "weight")(one_kv.weight, torch.cat([q, k]))  # a whole fused tensor
    assert torch.equal(one_kv.weight, torch.cat([q[4:], k]))
    row = Linear(6, 4, fmt=RowParallel(ctx))
    w = torch.randn(4, 6)
    weight_loader(row, "weight")(row.weight, w)
    assert torch.equal(row.weight, w[:, 3:])
    with pytest.raises(ValueError, match=r"expects shape \(4, 6\), the checkpoint has \(4, 3\)"):
        weight_loader(row, "weight")(row.weight, w[:, 3:])


def test_expert_format_loads_its_rank_slice():
    """Stacked [E, 2I, H] / [E, H, I] tensors and per-expert shards land as the same local slices."""
    from lamina.models.weight_formats import weight_loader
    from lamina.parallel.tp_formats import TPExperts

    gate_up, down = torch.randn(3, 8, 5), torch.randn(3, 5, 4)
    stacked = load_experts(TPExperts(ParallelContext(1, 2)), gate_up, down, per_expert=False)
    assert torch.equal(stacked.gate_up_proj, torch.cat([gate_up[:, 2:4], gate_up[:, 6:]], dim=1))
    assert torch.equal(stacked.down_proj, down[:, :, 2:])
    each = load_experts(TPExperts(ParallelContext(1, 2)), gate_up, down, per_expert=True)
    assert torch.equal(each.gate_up_proj, stacked.gate_up_proj) and torch.equal(each.down_proj, stacked.down_proj)
    with pytest.raises(ValueError, match=r"expects shape \(4, 5\), the checkpoint has \(2, 5\)"):
        weight_loader(each, "gate_up_proj")(each.gate_up_proj, gate_up[0, :2], "gate", 0)


def test_core_process_drives_workers_and_reports_a_lost_one(checkpoints):
    """Behind the server: the (daemonic) engine core process starts its worker, streams a request, and when
    the worker is killed the in-flight stream fails with the reason and the client stops running (/health
    503) instead of hanging."""
    import asyncio

    from lamina.engine.async_engine import AsyncEngine

    config = EngineConfig(model=str(checkpoints["qwen3"]), tensor_parallel_size=2, **{k: v for k, v in KW.items()
                                                                                      if k != "progress"})
    client = AsyncEngine.spawn(config)
    try:
        assert client.is_running
        workers = _spawned_children(client.pid)
        assert len(workers) == 1

        async def run() -> list:
            got = []
            async for out in client.generate("a", PROMPTS[0], SamplingParams(max_tokens=300, ignore_eos=True)):
                got.append(out)
                if len(got) == 2:
                    os.kill(workers[0], signal.SIGKILL)
            return got

        t0 = time.monotonic()
        with pytest.raises(Exception, match="worker 1"):
            asyncio.run(run())
        assert time.monotonic() - t0 < 60
        deadline = time.monotonic() + 10
        while client.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.is_running
    finally:
        client.shutdown(timeout=10)


def _spawned_children(pid: int) -> list[int]:
    """Ids of `pid`'s multiprocessing-spawned children other than its resource tracker (Linux /proc)."""
    out = []
    for stat in os.listdir("/proc"):
        if not stat.isdigit():
            continue
        try:
            with open(f"/proc/{stat}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{stat}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(int(stat))
    return out
