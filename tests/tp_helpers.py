"""What the tensor-parallel tests share (test_tensor_parallel, test_expert_parallel, test_tp_quant,
test_tp_hybrid): the engine settings, the prompts, the TP=1 vs TP=2 comparison (the oracle: the same engine at
tensor_parallel_size 1, fp32), and expert stacks loaded whole or one expert at a time."""
from __future__ import annotations

import torch

from lamina import LLM, SamplingParams

KW = dict(dtype="float32", device="cpu", num_kv_blocks=48, block_size=4, max_num_batched_tokens=32,
          progress=False)
PROMPTS = [[5, 17, 99, 1000, 42, 7, 3000, 12, 81, 640, 2, 9, 44], [7, 8, 9], [5, 17, 99, 1000, 42, 7, 3000, 11]]
# greedy with top-2 logprobs, prompt logprobs, and n = 2
TP_PARAMS = [SamplingParams(max_tokens=10, temperature=0.0, logprobs=2),
             SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, prompt_logprobs=1),
             SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, n=2)]


def tp_pair(path, params: list[SamplingParams] = TP_PARAMS, tp_only: dict | None = None, **both):
    """(TP=1 outputs, TP=2 outputs, the TP=2 LLM) for PROMPTS; `both` settings go to both engines, `tp_only`
    to the TP=2 one alone. The caller closes the LLM."""
    one = LLM(str(path), **KW, **both).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(path), tensor_parallel_size=2, **KW, **both, **(tp_only or {}))
    return one, llm.generate(PROMPTS, params, use_tqdm=False), llm


def assert_same(one, two) -> None:
    """Greedy tokens identical, sampled and prompt logprobs within 1e-4."""
    for a, b in zip(one, two):
        assert a.error is None and b.error is None
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids
            for ea, eb in zip(ca.logprobs, cb.logprobs):
                assert ea.keys() == eb.keys()
                for t in ea:
                    assert abs(ea[t].logprob - eb[t].logprob) < 1e-4
        if a.prompt_logprobs is not None:
            for ea, eb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                for t in ea:
                    assert abs(ea[t].logprob - eb[t].logprob) < 1e-4


def load_experts(fmt, gate_up: torch.Tensor, down: torch.Tensor, per_expert: bool):
    """A FusedExperts of format `fmt` from gate_up [E, 2I, H] and down [E, H, I]: the stacked tensors in one
    load each, or (per_expert) each expert's gate, up and down shards in turn, as a per-expert checkpoint."""
    from lamina.models.layers.moe import FusedExperts
    from lamina.models.weight_formats import weight_loader

    num, two_i, hidden = gate_up.shape
    inter = two_i // 2
    experts = FusedExperts(num, hidden, inter, fmt=fmt)
    if not per_expert:
        weight_loader(experts, "gate_up_proj")(experts.gate_up_proj, gate_up)
        weight_loader(experts, "down_proj")(experts.down_proj, down)
        return experts
    for e in range(num):
        weight_loader(experts, "gate_up_proj")(experts.gate_up_proj, gate_up[e, :inter], "gate", e)
        weight_loader(experts, "gate_up_proj")(experts.gate_up_proj, gate_up[e, inter:], "up", e)
        weight_loader(experts, "down_proj")(experts.down_proj, down[e], None, e)
    return experts
