"""Hybrid mixed-step graphs on the STRUCTURE of the Qwen3-Next-80B-A3B bench workload, scaled down to what
Triton's interpreter runs on a CPU: value heads = 2 x key heads (GQA inside the gated delta net), a GDN layer
before a gated-attention layer with query heads = 4 x KV heads, MoE in every layer (top-2 of 8 experts plus a
shared expert of the routed width, folded in as in the 80B model), prompts of several 64-token GDN chunks split
over several steps (continuation chunks start from the slot's state and conv window), many sequences, requests
joining while others decode, and graphs larger than the step (padding rows that span whole chunks, empty
sequence slots). The MoE layout's torch path (what the 80B shape's 11 pairs per token take above SMALL_PAIRS) is
forced from 128 pairs on, so both layout paths run inside graph bodies.

Each checked step runs the graph body through the Triton kernels on the padded metadata (host fields from the
key only) against the eager reference forward of the unpadded step (graph_body_check.TritonBodyCheck): logits
and every real slot's conv / recurrent state. Since a graph is captured once and replayed with other batches,
two steps of different compositions that replay one key must launch the very same kernels, grids, scalars and
torch ops, and the body must read nothing back to the host.
"""
from __future__ import annotations

import random

import pytest
import torch
from graph_body_check import TritonBodyCheck

from lamina import LLM, SamplingParams

LAYERS = ["linear_attention", "full_attention"]  # a GDN layer, then gated attention (the 80B's 3:1, cut to 1:1)
CONFIG = dict(hidden_size=64, num_hidden_layers=2, layer_types=LAYERS, num_attention_heads=8, num_key_value_heads=2,
              head_dim=16, partial_rotary_factor=0.25, max_position_embeddings=1024, initializer_range=0.1,
              intermediate_size=64, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
              mlp_only_layers=[], norm_topk_prob=True)
BUDGET = 96  # the engine's step budget: a 150-token prompt takes two steps, cut mid-chunk
GRAPH_TOKENS = 160  # the graphs go further: mixed sizes 16, 32, ..., 128, 144, 160
PAD = 64  # checked mixed steps replay the smallest graph with at least a whole chunk of padding rows
PROMPTS = [150, 3, 130, 70, 1, 65, 17]  # multi-chunk prompts cut across steps, a few tiny ones


def _checkpoint(path, tokenizer):
    import transformers

    if (path / "config.json").is_file():
        return path
    cfg = transformers.Qwen3NextConfig(**CONFIG, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                       eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(7)
    transformers.Qwen3NextForCausalLM(cfg).float().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _select_experts_torch(router_logits, top_k, renormalize, shared=False):
    """select_experts_triton's contract in torch: that kernel is one program per row (grid = rows, nothing from
    the host but shapes) and the slowest thing here under the interpreter."""
    routed = router_logits[:, :-1] if shared else router_logits
    weights, ids = torch.topk(torch.softmax(routed.float(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if shared:
        weights = torch.cat([weights, torch.sigmoid(router_logits[:, -1:].float())], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], routed.shape[1])], dim=1)
    return weights.to(router_logits.dtype), ids


class ReplayCheck(TritonBodyCheck):
    """Mixed steps replay a graph with at least PAD padding rows where one exists (capture sizes larger than the
    step: padding rows spanning whole chunks, as the 80B bench's ladder has above 512 tokens); every mixed step
    and two decode steps are checked."""

    def pick(self, batch):
        key = super().pick(batch)
        if key is None or key.decode:
            return key
        t = batch.input_ids.shape[0]
        bigger = [k for k in self.keys if not k.decode and k.tokens >= t + PAD and k.seqs > batch.ctx.attn.num_seqs]
        return min(bigger, key=lambda k: k.tokens) if bigger else key

    def want_check(self, batch, key) -> bool:
        return not key.decode or sum(1 for _, d, _ in self.checked if d) < 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU engine through Triton's interpreter (CI); on CUDA "
                    "tests/gpu/test_gpu_hybrid_graphs_80b_structure.py and scripts/hybrid_graph_check.py run the "
                    "real graphs")
def test_hybrid_mixed_graphs_on_the_80b_structure(tmp_path_factory, smol_tokenizer, monkeypatch):
    import lamina.kernels.triton_moe as triton_moe

    monkeypatch.setattr(triton_moe, "SMALL_PAIRS", 128)  # 3 pairs a token: the torch layout from 43 tokens on
    monkeypatch.setattr(triton_moe, "select_experts_triton", _select_experts_torch)
    path = _checkpoint(tmp_path_factory.getbasetemp() / "hybrid_80b_structure", smol_tokenizer)
    llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=16, num_kv_blocks=128, max_num_seqs=8,
              max_num_batched_tokens=BUDGET, progress=False)
    eng = llm.engine
    assert eng.model.config.gdn.num_v_heads == 2 * eng.model.config.gdn.num_k_heads
    eng.runner.graphs = graphs = ReplayCheck(eng.model, 8, eng.max_model_len, 16, eng.device,
                                             eng.state_pool.padding_slot, max_num_batched_tokens=GRAPH_TOKENS,
                                             mixed=True, state_pool=eng.state_pool, monkeypatch=monkeypatch)
    rng = random.Random(11)
    reqs = [(f"r{i}", {"prompt_token_ids": [rng.randrange(100, 4000) for _ in range(n)]},
             SamplingParams(temperature=0, max_tokens=rng.randint(2, 3), ignore_eos=True))
            for i, n in enumerate(PROMPTS)]
    step = 0
    while reqs or eng.has_unfinished_requests():
        if step % 2 == 0:  # two requests join every other step: prefill chunks meet decode rows
            for _ in range(2):
                if reqs:
                    eng.add_request(*reqs.pop(0))
        eng.step()
        step += 1
        assert not graphs.errors, graphs.errors
    mixed = [c for c in graphs.checked if not c[1]]
    assert len(mixed) >= 5, graphs.checked
    assert all(c[2] - c[0] >= PAD for c in mixed if c[0] <= GRAPH_TOKENS - PAD), graphs.checked
    assert any(graphs.compositions(k) > 1 for k in graphs.signatures if not k.decode), \
        ("no key replayed with two batch compositions", graphs.checked)
    assert graphs.worst < 1e-3, graphs.worst
    assert not graphs.host_reads, graphs.host_reads
    assert not graphs.signature_conflicts(), graphs.signature_conflicts()
    assert eng.state_pool.num_free == eng.state_pool.num_slots
    assert eng.allocator.num_free == eng.allocator.num_blocks
