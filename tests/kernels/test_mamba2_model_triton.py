"""A whole Nemotron-H model (Mamba-2, attention without RoPE, relu2 MLP) through the Triton kernels its layers
dispatch to (conv1d, the SSD scan / state update / verify, the grouped gated norm, the attention q/k/v prep)
gives the reference path's prompt logprobs and greedy tokens: chunked prefill of several sequences at once,
decode, and speculative verify steps with candidate states. On a CPU machine the kernels run in Triton's
interpreter (CPU tensors)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from kernel_helpers import INTERPRET

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "spec"))
from mamba2_factory import make_mamba2_checkpoint  # noqa: E402
from spec_helpers import OracleProposer, with_proposer  # noqa: E402

PROMPTS = [[100 + (i * 37 + j * 11) % 900 for i in range(n)] for j, n in enumerate((29, 9, 40))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, smol_tokenizer):
    return make_mamba2_checkpoint(tmp_path_factory.getbasetemp() / "mamba2_ckpt" / "nemotron_h", "nemotron_h",
                                  smol_tokenizer, seed=30)


def run(path, patch, proposer=None):
    with pytest.MonkeyPatch.context() as mp:  # its own: the fixture's monkeypatch holds TRITON_INTERPRET
        return _run(path, patch, mp, proposer)


def _run(path, patch, monkeypatch, proposer):
    from lamina import LLM, SamplingParams

    calls: list[str] = []
    if patch:
        import lamina.kernels.attention_prep as prep
        import lamina.kernels.conv1d as conv
        import lamina.kernels.mamba_ssd as ssd
        import lamina.kernels.norm_gated_grouped as norm
        import lamina.kernels.triton_mamba_ssd as tssd

        for mod in (prep, conv, ssd, norm):
            monkeypatch.setattr(mod, "use_triton", lambda t, name=mod.__name__: calls.append(name) or True)
        verify = tssd.mamba_ssd_verify_triton
        monkeypatch.setattr(tssd, "mamba_ssd_verify_triton",
                            lambda *a, **k: calls.append("verify") or verify(*a, **k))
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=4,
              max_num_batched_tokens=24, progress=False, enable_prefix_caching=False)
    if proposer is not None:
        llm = with_proposer(llm, proposer, 3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    lps = [torch.tensor([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]) for o, p in zip(outs, PROMPTS)]
    return [o.outputs[0].token_ids for o in outs], lps, calls


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs the interpreter or CUDA")
def test_nemotron_h_through_the_kernels_matches_the_reference(ckpt):
    ref_tokens, ref_lps, _ = run(ckpt, False)
    tokens, lps, calls = run(ckpt, True)
    assert {"lamina.kernels.conv1d", "lamina.kernels.mamba_ssd", "lamina.kernels.attention_prep",
            "lamina.kernels.norm_gated_grouped"} <= set(calls)
    assert tokens == ref_tokens
    assert max((a - b).abs().max().item() for a, b in zip(lps, ref_lps)) <= 1e-4
    # Verify steps (every draft right, then every draft wrong): the SSD verify kernel's candidate states
    # roll back exactly as the reference's.
    for wrong in (False, True):
        proposer = OracleProposer([{"prompt_token_ids": p} for p in PROMPTS], ref_tokens, wrong)
        tokens, _, calls = run(ckpt, True, proposer)
        assert tokens == ref_tokens and "verify" in calls
