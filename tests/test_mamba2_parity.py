"""Logprob and greedy parity with HF transformers for the Mamba-2 hybrids (Nemotron-H, Bamba) on tiny random fp32
checkpoints, with chunked prefill cutting the prompt inside the conv window (K=4) and inside and across the
16-token scan chunks; the config and checkpoint-name mapping; the grouped gated norm against HF's module."""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hybrid_helpers import hf_greedy, hf_logprobs
from mamba2_factory import CHUNK, FAMILIES, NEMOTRON_PATTERN, mamba2_checkpoints
from safetensors.torch import load_file, save_file

from lamina import LLM, SamplingParams

# 70 tokens: four full scan chunks of 16 and a partial one in one prefill.
PROMPT = [(i * 7919) % 40000 + 100 for i in range(70)]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smol_tokenizer):
    return mamba2_checkpoints(tmp_path_factory, smol_tokenizer)


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
    return eng.allocator.num_free == eng.allocator.num_blocks and pool.num_free == pool.num_slots \
        and not eng.scheduler.running and not eng.groups


def prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                       use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])


@pytest.mark.parametrize("family", list(FAMILIES))
# 3: shorter than the conv window; 7: inside a scan chunk; 21: across one; 4096: the whole prompt at once.
@pytest.mark.parametrize("chunk", [4096, 21, 7, 3])
def test_prompt_logprobs_match_hf(ckpts, family, chunk):
    llm = make(ckpts[family], max_num_batched_tokens=chunk)
    ours = prompt_logprobs(llm, PROMPT)
    assert (ours - _hf_chosen(ckpts[family])).abs().max().item() <= 1e-4
    assert all_free(llm)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf_generate(ckpts, family):
    """64 greedy decode steps: the SSD state update and the conv update must carry state like HF's cache."""
    prompt = PROMPT[:37]
    llm = make(ckpts[family], max_num_batched_tokens=11)  # the prompt itself arrives in chunks too
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(ckpts[family], prompt, 64)
    assert all_free(llm)


def test_family_configs(ckpts):
    from lamina.models.hf_loader import read_hf_config
    from lamina.models.registry import config_from_hf

    nem = config_from_hf(read_hf_config(ckpts["nemotron_h"]))
    kinds = {"M": ("mamba2", "none"), "*": ("attention", "none"), "-": ("none", "plain")}
    assert [(s.mixer, s.ffn) for s in nem.layers] == [kinds[c] for c in NEMOTRON_PATTERN]
    assert nem.single_sublayer and nem.rotary_dim == 0 and nem.hidden_act == "relu2"
    m = nem.mamba2
    assert (m.num_heads, m.head_dim, m.state_size, m.n_groups, m.chunk_size) == (8, 8, 16, 2, CHUNK)
    assert m.conv_dim == 8 * 8 + 2 * 2 * 16 and m.dt_min == 0.01 and m.dt_max == float("inf")
    from lamina.models.families.nemotron_h import mamba_spec  # no limit in the config: none (not time_step_min)
    bare = {k: v for k, v in read_hf_config(ckpts["nemotron_h"]).items() if k != "time_step_limit"}
    assert (mamba_spec(bare).dt_min, mamba_spec(bare).dt_max) == (0.0, float("inf"))
    legacy = {**bare, "mamba_dt_limit": [0.05, 2.0]}  # NVIDIA's own config name
    assert (mamba_spec(legacy).dt_min, mamba_spec(legacy).dt_max) == (0.05, 2.0)
    moe = config_from_hf(read_hf_config(ckpts["nemotron_h_moe"]))
    assert [s.ffn for s in moe.layers] == ["none", "relu2_moe", "none", "relu2_moe", "none"]
    r = moe.relu2_moe
    assert (r.num_experts, r.top_k, r.n_group, r.topk_group, r.routed_scaling_factor) == (8, 2, 2, 1, 2.5)
    assert (r.intermediate_size, r.shared_intermediate_size, r.latent_size) == (32, 48, None)
    bam = config_from_hf(read_hf_config(ckpts["bamba"]))
    assert [s.mixer for s in bam.layers] == ["mamba2", "attention", "mamba2", "mamba2"]
    assert all(s.ffn == "dense" for s in bam.layers) and not bam.single_sublayer
    assert bam.rotary_dim == 8  # half of head_dim 16
    assert (bam.mamba2.num_heads, bam.mamba2.head_dim, bam.mamba2.dt_max) == (8, 16, float("inf"))


def test_nemotron_legacy_config_and_names(ckpts, tmp_path):
    """NVIDIA's own configs spell the pattern as hybrid_override_pattern (and mamba_* names); checkpoints may
    use model.* instead of backbone.*. Both load to the same logprobs."""
    src = ckpts["nemotron_h"]
    dst = tmp_path / "legacy"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("layers_block_type", None)
    cfg["hybrid_override_pattern"] = NEMOTRON_PATTERN
    cfg["mamba_n_groups"], cfg["mamba_d_conv"], cfg["mamba_chunk_size"] = (cfg.pop("n_groups"),
                                                                           cfg.pop("conv_kernel"),
                                                                           cfg.pop("chunk_size"))
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(dst / "model.safetensors"))
    save_file({k.replace("backbone.", "model.", 1): v for k, v in tensors.items()}, str(dst / "model.safetensors"))
    a, b = prompt_logprobs(make(src), PROMPT[:20]), prompt_logprobs(make(dst), PROMPT[:20])
    assert torch.equal(a, b)


def test_unsupported_nemotron_blocks_are_refused():
    from lamina.models.registry import config_from_hf

    hf = dict(architectures=["NemotronHForCausalLM"], hybrid_override_pattern="M*E", vocab_size=10, hidden_size=8,
              num_attention_heads=2, mamba_num_heads=2, mamba_head_dim=4)
    with pytest.raises(ValueError, match="unsupported block types"):
        config_from_hf(dict(hf, hybrid_override_pattern=None, layers_block_type=["mamba"]))
    with pytest.raises(ValueError, match="unknown hybrid_override_pattern"):
        config_from_hf(dict(hf, hybrid_override_pattern="M*X"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gated_norm_matches_hf(dtype):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    from lamina.kernels.norm_gated_grouped import grouped_gated_rms_norm_ref

    torch.manual_seed(0)
    y, z = torch.randn(5, 24, dtype=dtype), torch.randn(5, 24, dtype=dtype)
    hf = NemotronHRMSNormGated(24, group_size=8, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(24))
        ref = hf(y, z)
    assert torch.equal(grouped_gated_rms_norm_ref(y, z, hf.weight.detach(), 8, 1e-5), ref)


def test_lamina_verify_passes_on_nemotron_h(ckpts, tmp_path):
    """`lamina verify` (the console script) on the random Nemotron-H checkpoint: every prompt PASS, exit 0."""
    exe = shutil.which("lamina") or str(Path(sys.executable).parent / "lamina")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
           "OMP_NUM_THREADS": "1"}
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe capital of France is\\nParis, and the capital of Italy is\n")
    r = subprocess.run([exe, "verify", str(ckpts["nemotron_h"]), "--prompts", str(prompts), "--max-tokens", "8"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert sum("PASS" in line and line.startswith("prompt ") for line in lines) == 2
    assert "greedy agree 8/8" in r.stdout and lines[-1].startswith("PASS: 2/2")
