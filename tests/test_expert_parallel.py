"""Expert parallelism and DeepSeek (MLA + DeepSeek MoE) under tensor parallelism, on the CPU (gloo, 2 processes).

Oracle: the same engine at tensor_parallel_size 1 (itself checked against HF transformers by
test_parity_hf.py / test_deepseek_parity.py), fp32: greedy tokens identical, logprobs within 1e-4. Each
TP=2 engine costs one worker start, so each model's engine is made once per module.
"""
from __future__ import annotations

import logging

import pytest
import torch
from deepseek_factory import make_deepseek_checkpoint
from tp_helpers import assert_same, load_experts, tp_pair

from lamina import SamplingParams
from lamina.kernels.moe import fused_moe_ref
from lamina.models.config import LayerSpec, ModelConfig, MoESpec
from lamina.parallel.context import ParallelContext
from lamina.parallel.expert_parallel import EPExperts, check_ep_config

PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, logprobs=2),
          SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, prompt_logprobs=1),
          SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)]


def _moe_layers(model) -> list:
    from lamina.models.layers.moe import SparseMoE

    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def _check_load(llm, top_k: int) -> None:
    """One fresh prompt of L tokens, M generated: L + M - 1 tokens go through each MoE layer, top_k pairs each."""
    load = llm.engine.expert_load
    before = load.read()
    prompt, m = [11, 22, 33, 44, 55, 66, 77], 4
    llm.generate([prompt], SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), use_tqdm=False)
    after = llm.engine.stats().expert_parallel_routed_tokens
    routed = [a - b for a, b in zip(after, before)]
    assert len(routed) == 2 and min(routed) >= 0
    assert sum(routed) == (len(prompt) + m - 1) * top_k * len(_moe_layers(llm.engine.model))


@pytest.fixture(scope="module")
def qwen3_moe_ep(tmp_path_factory, smol_tokenizer, one_thread):
    from hybrid_helpers import make_hybrid_checkpoint

    path = make_hybrid_checkpoint(tmp_path_factory.mktemp("ep") / "qwen3_moe", "qwen3_moe", smol_tokenizer, seed=6)
    one, two, llm = tp_pair(path, PARAMS, tp_only={"enable_expert_parallel": True})
    yield one, two, llm
    llm.engine.close()


def test_qwen3_moe_ep_matches_tp1(qwen3_moe_ep):
    one, two, llm = qwen3_moe_ep
    assert_same(one, two)
    experts = _moe_layers(llm.engine.model)[0].experts
    assert isinstance(experts.format, EPExperts) and experts.format.first == 0
    # 4 experts over 2 ranks: rank 0 holds experts 0 and 1, whole (intermediate 32, not split)
    assert tuple(experts.gate_up_proj.shape) == (2, 64, 64) and tuple(experts.down_proj.shape) == (2, 64, 32)


def test_qwen3_moe_ep_load_counts(qwen3_moe_ep):
    _, _, llm = qwen3_moe_ep
    _check_load(llm, llm.engine.model_config.moe.top_k)


def test_bench_throughput_reports_the_ranks_load(qwen3_moe_ep):
    from lamina.bench.offline import run_throughput
    from lamina.bench.workload import Workload

    _, _, llm = qwen3_moe_ep
    wl = Workload([[100 + i, 200 + i, 300 + i] for i in range(3)], [3, 3, 3])
    res = run_throughput(llm, wl)
    moe = len(_moe_layers(llm.engine.model))
    assert sum(res["expert_parallel_routed_tokens"]) == (3 * 3 + 3 * 2) * llm.engine.model_config.moe.top_k * moe
    assert res["expert_parallel_imbalance"] >= 1.0


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory, smol_tokenizer):
    return make_deepseek_checkpoint(tmp_path_factory.mktemp("ep") / "v3", "deepseek_v3", smol_tokenizer, seed=2)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "tp_ep"])
def test_deepseek_v3_tp2_matches_tp1(v3_checkpoint, ep, one_thread):
    """MLA heads split (q_lora, YaRN, interleaved rope), noaux_tc grouped routing replicated, shared experts
    and the dense first layer tensor-parallel; routed experts split (TP) or placed whole (EP)."""
    one, two, llm = tp_pair(v3_checkpoint, PARAMS, tp_only={"enable_expert_parallel": ep})
    try:
        assert_same(one, two)
        attn = llm.engine.model.model.layers[0].self_attn
        assert attn.num_heads == 2 and attn._absorbed[0].shape[0] == 2  # local heads, local absorbed weights
        assert llm.engine.kv_cache.views[0].kv.shape[-1] == 32 + 16  # the full latent per token on every rank
        experts = _moe_layers(llm.engine.model)[0].experts
        assert tuple(experts.down_proj.shape) == ((4, 64, 32) if ep else (8, 64, 16))
        if ep:
            _check_load(llm, 3)
        else:
            assert llm.engine.expert_load is None and llm.engine.stats().expert_parallel_routed_tokens is None
    finally:
        llm.engine.close()


def test_deepseek_v2_ep_matches_tp1(tmp_path_factory, smol_tokenizer, one_thread):
    """V2-Lite's layout: no q_lora (q_proj column-parallel), group-limited greedy softmax routing, 2 shared
    experts."""
    path = make_deepseek_checkpoint(tmp_path_factory.mktemp("ep") / "v2", "deepseek_v2", smol_tokenizer, seed=3)
    one, two, llm = tp_pair(path, PARAMS, tp_only={"enable_expert_parallel": True})
    try:
        assert_same(one, two)
    finally:
        llm.engine.close()


def test_ep_format_loads_its_experts_only():
    """Rank 1 of 2 over 4 experts holds experts 2 and 3: stacked tensors are cut, the other experts' per-expert
    tensors are skipped, and its parts name only its experts (the missing-tensor check asks for those)."""
    from lamina.models.weight_formats import param_spec, weight_loader

    gate_up, down = torch.randn(4, 8, 5), torch.randn(4, 5, 4)
    stacked = load_experts(EPExperts(ParallelContext(1, 2)), gate_up, down, per_expert=False)
    assert torch.equal(stacked.gate_up_proj, gate_up[2:]) and torch.equal(stacked.down_proj, down[2:])
    each = load_experts(EPExperts(ParallelContext(1, 2)), gate_up, down, per_expert=True)
    assert torch.equal(each.gate_up_proj, stacked.gate_up_proj) and torch.equal(each.down_proj, stacked.down_proj)
    assert param_spec(each, "down_proj").parts == ("2", "3")
    with pytest.raises(ValueError, match="expert 4 is out of range"):
        weight_loader(each, "down_proj")(each.down_proj, down[0], None, 4)


def test_ranks_partial_outputs_sum_to_the_whole():
    """What the all-reduce adds up: each rank's local experts on the pairs routed to them (others -> the
    sentinel) sum to every expert on every pair."""
    gen = torch.Generator().manual_seed(0)
    x, w13 = torch.randn(7, 6, generator=gen), torch.randn(6, 10, 6, generator=gen)
    w2, weights = torch.randn(6, 6, 5, generator=gen), torch.rand(7, 2, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(7)])
    whole = fused_moe_ref(x, w13, w2, weights, ids)
    parts = []
    for rank in range(3):
        fmt = EPExperts(ParallelContext(rank, 3))
        fmt.local, fmt.first = 2, 2 * rank
        parts.append(fused_moe_ref(x, w13[2 * rank:2 * rank + 2], w2[2 * rank:2 * rank + 2], weights,
                                   fmt.local_ids(ids.clone())))
    assert torch.allclose(sum(parts), whole, atol=1e-5)


def _moe_config(experts: int | None) -> ModelConfig:
    moe = MoESpec(num_experts=experts, top_k=2, intermediate_size=8, renormalize=True) if experts else None
    return ModelConfig("qwen3_moe", 64, 16, 32, 4, 2, 4, [LayerSpec("attention", "moe" if moe else "dense")],
                       moe=moe)


def test_bad_ep_configs(caplog):
    with pytest.raises(ValueError, match=r"6 routed experts do not divide by --tensor-parallel-size 4") as info:
        check_ep_config(_moe_config(6), 4, True)
    assert "\n" not in str(info.value)
    with caplog.at_level(logging.WARNING, logger="lamina"):
        assert not check_ep_config(_moe_config(None), 2, True, warn=True)  # a dense model: ignored, one line
    assert "ignored" in caplog.text and "no routed experts" in caplog.text
    assert check_ep_config(_moe_config(8), 4, True) and not check_ep_config(_moe_config(8), 4, False)


def test_cli_flag():
    from lamina.args import CliParser, add_engine_args, engine_kwargs

    p = CliParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--model", "m", "-tp", "2", "--enable-expert-parallel"]))
    assert kw["enable_expert_parallel"] is True and kw["tensor_parallel_size"] == 2


def test_routed_counts_metric():
    """lamina:expert_parallel_routed_tokens{rank} takes the increments of the running totals."""
    from lamina.engine.engine_stats import EngineStats
    from lamina.engine.ipc import IterationStats
    from lamina.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    m.on_iteration(IterationStats(), EngineStats(0, 0, 8, 8, expert_parallel_routed_tokens=[3, 5]))
    m.on_iteration(IterationStats(), EngineStats(0, 0, 8, 8, expert_parallel_routed_tokens=[4, 9]))
    text = m.render()[0].decode()
    assert 'lamina:expert_parallel_routed_tokens_total{model_name="m",rank="0"} 4.0' in text
    assert 'lamina:expert_parallel_routed_tokens_total{model_name="m",rank="1"} 9.0' in text
