"""A hybrid model's CUDA-graph body run through the Triton kernels (Triton's interpreter on a CPU) on the padded
graph metadata, whose host fields describe only the key (exact_host=False, as in a capture), against the eager
forward through the torch references on the unpadded step.

This is the capture's code path minus the graph itself: every kernel choice and grid must come from the key's
shapes and every per-step number from the device buffers. Checked for mixed steps (prefill chunks next to
decode rows, the padding sequence, empty slots) and decode steps of a real generation: logits, and every
real sequence's conv and recurrent states; the padding slot alone may differ.
"""
from __future__ import annotations

import importlib
import random

import pytest
import torch
from hybrid_helpers import make_hybrid_checkpoint

from lamina import LLM, SamplingParams
from lamina.engine.cuda_graph import CudaGraphRunner

# Modules that bind dispatch.use_triton at import: switched to the Triton kernels for the graph body only.
DISPATCHING = ["gemv", "norm_gated", "attention_prep", "norm", "conv1d", "gated_delta", "moe", "rope", "activation",
               "attention"]


class TritonBodyCheck(CudaGraphRunner):
    """Runs each step's graph body through the Triton kernels (non-exact host fields) and compares it with the
    eager reference forward of the same step; returns the reference logits. At most max_checks steps of each
    kind are checked (the interpreter is slow); the others run the reference only."""

    def __init__(self, *a, state_pool, monkeypatch, max_checks=3, **kw):
        super().__init__(*a, **kw)
        self.state_pool, self.mp, self.max_checks = state_pool, monkeypatch, max_checks
        self.checked: list[tuple[int, bool, int]] = []  # (real rows, decode graph, padded rows)
        self.worst = 0.0
        self.errors: list[str] = []  # the engine turns a failing step into failed requests: keep the reason

    def run(self, batch):
        try:
            return self._run(batch)
        except AssertionError as e:
            self.errors.append(repr(e))
            raise

    def _run(self, batch):
        key = self.pick(batch)
        pool = [t for pair in self.state_pool.tensors for t in pair]
        before = [t.clone() for t in pool]
        with torch.inference_mode():
            ref = self.model(batch.input_ids, batch.positions, batch.ctx, batch.logits_indices)
        if sum(1 for _, d, _ in self.checked if d == key.decode) >= self.max_checks:
            return ref
        after = [t.clone() for t in pool]
        for t, b in zip(pool, before):
            t.copy_(b)
        with self.mp.context() as m:
            for name in DISPATCHING:
                m.setattr(importlib.import_module(f"lamina.kernels.{name}"), "use_triton", lambda t: True)
            with torch.inference_mode():
                self.inputs.load(batch, key)
                got = self.logits(batch, self.body(key, exact_host=False))
        pad = self.padding_slot
        for t, a in zip(pool, after):
            err = (t[:pad].float() - a[:pad].float()).abs().max().item()
            assert err < 1e-3, ("state", err)
        if ref.numel():
            self.worst = max(self.worst, (got - ref).abs().max().item())
        self.checked.append((batch.input_ids.shape[0], key.decode, key.tokens))
        for t, a in zip(pool, after):  # continue from the reference's states
            t.copy_(a)
        return ref


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
                                                 mixed=True,  # opt-in for hybrid models (cuda_graph.py)
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
    assert eng.state_pool.num_free == eng.state_pool.num_slots
    assert eng.allocator.num_free == eng.allocator.num_blocks
