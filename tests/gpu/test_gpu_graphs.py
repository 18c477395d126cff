"""GPU (skips without CUDA): mixed prefill+decode steps replay CUDA graphs and give the eager engine's tokens
and logprobs (fp32), for chunked prefill, sliding windows and prompt logprobs; no step runs eagerly."""
from __future__ import annotations

import pytest
import torch

from lamina import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = [1000 + (37 * i) % 3000 for i in range(400)]


def _count(llm):
    runner, seen = llm.engine.runner, []
    orig = runner.execute

    def execute(batch):
        seen.append(runner.graphs.pick(batch) if runner.graphs is not None else None)
        return orig(batch)

    runner.execute = execute
    return seen


@pytest.mark.parametrize("family", ["qwen3", "mistral"])  # mistral: sliding window 12
@pytest.mark.parametrize("budget", [64, 512])
def test_mixed_steps_use_graphs_and_match_eager(checkpoints, family, budget):
    path = checkpoints[family]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1) for _ in range(11)]
    params.append(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1))
    prompts = [{"prompt_token_ids": PROMPT[: 3 + 31 * i]} for i in range(12)]
    kw = {"dtype": "float32", "device": "cuda", "num_kv_blocks": 512, "max_num_batched_tokens": budget,
          "max_num_seqs": 8, "progress": False}
    graph = LLM(model=str(path), **kw)
    assert graph.engine.runner.graphs.mixed_sizes, "mixed graphs were not captured"
    seen = _count(graph)
    eager = LLM(model=str(path), enforce_eager=True, **kw)
    a = graph.generate(prompts, params, use_tqdm=False)
    b = eager.generate(prompts, params, use_tqdm=False)
    assert all(k is not None for k in seen), "a step ran eagerly"
    assert any(not k.decode for k in seen) and any(k.decode for k in seen)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for p, q, t in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or [], x.outputs[0].token_ids):
            assert abs(p[t].logprob - q[t].logprob) < 1e-3
    pa, pb = a[-1].prompt_logprobs, b[-1].prompt_logprobs
    assert len(pa) == len(pb) == len(prompts[-1]["prompt_token_ids"])
    for p, q in zip(pa[1:], pb[1:]):
        assert all(abs(p[t].logprob - q[t].logprob) < 1e-3 for t in p if t in q)
    eng = graph.engine
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.groups
