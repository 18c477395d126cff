"""Hybrid verify graphs through the Triton kernels (Triton's interpreter on a CPU) on the 80B model's structure
scaled down (tests/kernels/test_hybrid_graph_replay.py's model): each checked verify step runs the verify graph's
body on the padded metadata whose host fields describe only the key (query-length bound K + 1, padding
sequences, the device candidate table) against the eager reference forward of the unpadded step: logits and
every real slot's state, candidate slots included. Drafts are right or wrong by position, so verify runs stop
at different drafts and steps of one key differ in composition; a key replayed with two compositions must
launch the very same kernels, and the body must read nothing back to the host. Greedy tokens equal the plain
run's."""
from __future__ import annotations

import random

import pytest
import torch
from graph_body_check import TritonBodyCheck
from test_hybrid_graph_replay import _checkpoint, _select_experts_torch

from lamina import LLM, SamplingParams
from lamina.spec.config import parse_speculative_config
from lamina.spec.decoder import SpecDecoder

K = 3


class PositionDrafts:
    """The reference continuation, with the draft for output position n wrong when n % 3 == 2."""

    def __init__(self, ref: dict) -> None:
        self.ref = ref

    def propose(self, seqs, k):
        out = []
        for s in seqs:
            ref, n = self.ref[tuple(s.prompt_token_ids)], s.num_output_tokens
            out.append([t if (n + j) % 3 != 2 else t + 1 for j, t in enumerate(ref[n:n + k])])
        return out


class VerifyCheck(TritonBodyCheck):
    def want_check(self, batch, key) -> bool:
        return bool(key.verify) and len(self.checked) < 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU engine through Triton's interpreter (CI); on CUDA "
                    "scripts/gpu_spec_bench.py (stage graphs) replays the real graphs")
def test_hybrid_verify_graphs_on_the_80b_structure(tmp_path_factory, smol_tokenizer, monkeypatch):
    import lamina.kernels.triton_moe as triton_moe

    monkeypatch.setattr(triton_moe, "select_experts_triton", _select_experts_torch)
    path = _checkpoint(tmp_path_factory.getbasetemp() / "hybrid_80b_structure", smol_tokenizer)
    kw = dict(model=str(path), dtype="float32", device="cpu", block_size=16, num_kv_blocks=128, max_num_seqs=8,
              max_num_batched_tokens=96, progress=False)
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 4000) for _ in range(n)]} for n in (9, 3, 20, 5, 14)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]

    llm = LLM(**kw)
    eng = llm.engine
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0})
    eng.spec = SpecDecoder(cfg, PositionDrafts({tuple(p["prompt_token_ids"]): o for p, o in zip(prompts, want)}))
    eng.runner.graphs = graphs = VerifyCheck(eng.model, 8, eng.max_model_len, 16, eng.device,
                                             eng.state_pool.padding_slot, max_num_batched_tokens=96, mixed=False,
                                             state_pool=eng.state_pool, monkeypatch=monkeypatch,
                                             verify_width=K + 1)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not graphs.errors, graphs.errors
    assert got == want
    assert len(graphs.checked) >= 3 and all(rows < padded for rows, _, padded in graphs.checked), graphs.checked
    assert any(graphs.compositions(k) > 1 for k in graphs.signatures), ("no key with two compositions",
                                                                         graphs.checked)
    assert graphs.worst < 1e-3, graphs.worst
    assert not graphs.host_reads, graphs.host_reads
    assert not graphs.signature_conflicts(), graphs.signature_conflicts()
    st = eng.stats()
    assert 0 < st.num_spec_accepted_tokens < st.num_spec_draft_tokens
    assert eng.state_pool.num_free == eng.state_pool.num_slots and eng.allocator.num_free == eng.allocator.num_blocks
