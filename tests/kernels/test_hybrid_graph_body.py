"""A hybrid model's CUDA-graph body run through the Triton kernels (Triton's interpreter on a CPU) on the padded
graph metadata, whose host fields describe only the key (exact_host=False, as in a capture), against the eager
forward through the torch references on the unpadded step.

This is the capture's code path minus the graph itself: every kernel choice and grid must come from the key's
shapes and every per-step number from the device buffers. Checked for mixed steps (prefill chunks next to
decode rows, the padding sequence, empty slots) and decode steps of a real generation: logits, and every
real sequence's conv and recurrent states; the padding slot alone may differ.
"""
from __future__ import annotations

import random

import pytest
import torch
from graph_body_check import TritonBodyCheck
from hybrid_helpers import make_hybrid_checkpoint

from lamina import LLM, SamplingParams


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU engine through Triton's interpreter (CI); on CUDA "
                    "tests/gpu/test_gpu_hybrid_graphs.py runs the real graphs")
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_graph_body_through_triton_kernels(tmp_path_factory, smol_tokenizer, family, monkeypatch):
    from hybrid_helpers import FAMILIES

    path = make_hybrid_checkpoint(tmp_path_factory.getbasetemp() / "hybrid_ckpt" / family, family, smol_tokenizer,
                                  seed=10 + list(FAMILIES).index(family))
    llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=128, max_num_seqs=4,
              max_num_batched_tokens=32, progress=False)
    eng = llm.engine
    eng.runner.graphs = graphs = TritonBodyCheck(eng.model, 4, eng.max_model_len, 4, eng.device,
                                                 eng.state_pool.padding_slot, max_num_batched_tokens=32,
                                                 mixed=True,
                                                 state_pool=eng.state_pool, monkeypatch=monkeypatch)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 4000) for _ in range(n)]} for n in (3, 40, 1, 17)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    assert not graphs.errors, graphs.errors
    mixed = [c for c in graphs.checked if not c[1]]
    assert mixed and any(c[2] > c[0] for c in mixed), "no padded mixed step was checked"
    assert any(c[1] for c in graphs.checked), "no decode step was checked"
    assert graphs.worst < 1e-3, graphs.worst
    assert not graphs.host_reads, graphs.host_reads
    assert not graphs.signature_conflicts(), graphs.signature_conflicts()
    assert eng.state_pool.num_free == eng.state_pool.num_slots
    assert eng.allocator.num_free == eng.allocator.num_blocks
