"""GGUF kept packed on the GPU (skips without CUDA or LAMINA_SMOLLM2_GGUF): the built-in SmolLM2 from its
Q4_1/Q8_0 blocks through the Triton quantized matmul, against the same model dequantized (both bf16, both
with CUDA graphs): prompt logprobs within bf16 noise, greedy tokens equal until a near-tie."""
from __future__ import annotations

import os

import pytest
import torch

from lamina import LLM, SamplingParams

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not os.environ.get("LAMINA_SMOLLM2_GGUF"), reason="set LAMINA_SMOLLM2_GGUF")]
TEXT = ("ROMEO: But, soft! what light through yonder window breaks? It is the east, and Juliet is the sun. "
        "Arise, fair sun, and kill the envious moon, who is already sick and pale with grief.")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_packed_gguf_on_gpu_matches_dequantized(dtype):
    path = os.environ["LAMINA_SMOLLM2_GGUF"]
    packed = LLM(model=path, dtype=dtype, device="cuda", progress=False)
    dense = LLM(model=path, dtype=dtype, device="cuda", progress=False, dequantize_gguf=True)
    layer = packed.engine.model.model.layers[0].mlp.gate_up_proj
    assert type(layer.format).__name__ == "GGUFFormat" and layer.weight.is_cuda
    ids = packed.get_tokenizer()(TEXT).input_ids
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    lp = [torch.tensor([o.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
          for o in (llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0] for llm in (packed, dense))]
    diff = (lp[0] - lp[1]).abs()
    bound = (0.077, 0.34) if dtype == "bfloat16" else (1e-3, 1e-2)  # bf16: the CPU-measured bf16 model noise
    assert diff.mean() < bound[0] and diff.max() < bound[1], (diff.mean(), diff.max())
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    got = packed.generate({"prompt_token_ids": ids[:20]}, greedy, use_tqdm=False)[0].outputs[0]
    want = dense.generate({"prompt_token_ids": ids[:20]}, greedy, use_tqdm=False)[0].outputs[0]
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if a != b:
            top = sorted((p.logprob for p in want.logprobs[i].values()), reverse=True)[:2]
            assert top[0] - top[1] < 0.1, (i, a, b, top)
            break
