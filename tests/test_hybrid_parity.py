"""Logprob and greedy parity with HF transformers for the hybrid / MoE families (Qwen3-MoE, Qwen3-Next,
Qwen3.5, Qwen3.5-MoE) on tiny random fp32 checkpoints, with chunked prefill cutting the prompt inside and
across the conv window (K=4) and the 64-token delta-rule chunk."""
from __future__ import annotations

import functools

import pytest
import torch
from hybrid_helpers import FAMILIES, hf_greedy, hf_logprobs, hybrid_checkpoints
from safetensors.torch import load_file, save_file

from lamina import LLM, SamplingParams

# 150 tokens: three delta-rule chunks (64 + 64 + 22) in one prefill.
PROMPT = [(i * 7919) % 40000 + 100 for i in range(150)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smol_tokenizer):
    return hybrid_checkpoints(tmp_path_factory, smol_tokenizer)


@functools.cache
def _hf_chosen(path) -> torch.Tensor:
    ref = hf_logprobs(path, PROMPT)
    return ref[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4,
          "progress": False, **kw}
    return LLM(model=str(path), **kw)


def all_free(llm: LLM) -> bool:
    eng = llm.engine
    pool = eng.state_pool
    return eng.allocator.num_free == eng.allocator.num_blocks and \
        (pool is None or pool.num_free == pool.num_slots) and not eng.scheduler.running and not eng.groups


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("chunk", [4096, 67, 7, 3])  # 3 < K-1+1, 7 inside a block, 67 just past a 64-chunk
def test_prompt_logprobs_match_hf(ckpts, family, chunk):
    llm = make(ckpts[family], max_num_batched_tokens=chunk)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    assert (ours - _hf_chosen(ckpts[family])).abs().max().item() <= 1e-4
    assert all_free(llm)
    # qwen3_5_moe's shared expert is folded into the routed experts; qwen3_next's (wider) is not.
    from lamina.models.layers.moe import SparseMoE

    fused = {m.shared_fused for m in llm.engine.model.modules() if isinstance(m, SparseMoE)}
    assert fused == {"qwen3_5_moe": {True}, "qwen3_next": {False}, "qwen3_moe": {False}}.get(family, set())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf_generate(ckpts, family):
    """64 greedy decode steps: the recurrent step and the conv update must carry state like HF's cache."""
    prompt = PROMPT[:37]
    llm = make(ckpts[family], max_num_batched_tokens=16)  # the prompt itself arrives in chunks too
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(ckpts[family], prompt, 64)
    assert all_free(llm)


def test_family_configs(ckpts):
    from lamina.models.hf_loader import read_hf_config
    from lamina.models.registry import config_from_hf

    cfg = {f: config_from_hf(read_hf_config(p)) for f, p in ckpts.items()}
    assert [(s.mixer, s.ffn) for s in cfg["qwen3_moe"].layers] == [("attention", "moe"), ("attention", "dense"),
                                                                   ("attention", "moe")]
    assert cfg["qwen3_moe"].moe.renormalize and cfg["qwen3_moe"].moe.shared_intermediate_size == 0
    assert [(s.mixer, s.ffn) for s in cfg["qwen3_next"].layers] == [
        ("gated_delta_net", "moe"), ("gated_attention", "moe"), ("gated_delta_net", "dense")]
    assert cfg["qwen3_next"].moe.shared_intermediate_size == 48 and cfg["qwen3_next"].norm_offset == 1.0
    assert cfg["qwen3_5"].family == "qwen3_5" and cfg["qwen3_5"].moe is None
    assert cfg["qwen3_5"].rotary_dim == 4  # partial_rotary_factor 0.25 of head_dim 16
    assert all(s.ffn == "moe" for s in cfg["qwen3_5_moe"].layers) and cfg["qwen3_5_moe"].moe.renormalize
    assert cfg["qwen3_5_moe"].gdn.num_v_heads == 4 and cfg["qwen3_5_moe"].gdn.num_k_heads == 2


def test_stacked_expert_checkpoint_loads(ckpts, tmp_path):
    """Checkpoints may hold experts stacked ([E, 2I, H] gate|up, [E, H, I]) instead of one tensor per expert."""
    import shutil

    src = ckpts["qwen3_5_moe"]
    dst = tmp_path / "stacked"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    stacked: dict[str, torch.Tensor] = {}
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")])
                   for e in range(4)]
        stacked[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        stacked[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(4)])
    save_file({**tensors, **stacked}, str(dst / "model.safetensors"))
    a, b = make(src), make(dst)
    ma, mb = a.engine.model.model.layers[0].mlp.experts, b.engine.model.model.layers[0].mlp.experts
    assert torch.equal(ma.gate_up_proj, mb.gate_up_proj) and torch.equal(ma.down_proj, mb.down_proj)


def test_missing_expert_is_reported(ckpts, tmp_path):
    import shutil

    dst = tmp_path / "broken"
    shutil.copytree(ckpts["qwen3_moe"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        make(dst)
