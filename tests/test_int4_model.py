"""A small GPTQ checkpoint (act-order, asymmetric, group 32, written to the GPTQ v1 definition from a
round-to-nearest quantization of the tiny llama) run by lamina from its packed weights, against HF
transformers running the dense fp32 copy those integers define: prompt logprobs."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from int4_checkpoints import dense_weight, gptq_tensors
from model_factory import hf_logprobs
from safetensors.torch import load_file, save_file

GROUP = 32
QUANT = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
         "checkpoint_format": "gptq"}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn(w: torch.Tensor, g_idx: torch.Tensor):
    """Round-to-nearest asymmetric 4-bit per (row, group), groups given by g_idx: (q, z, s)."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(groups)], 1)
    hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(groups)], 1)
    s = ((hi - lo) / 15).clamp_min(1e-6).half()
    z = torch.round(-lo / s.float()).clamp(1, 15)  # v1 GPTQ cannot store a zero point of 0
    q = torch.round(w / s.float()[:, g_idx.long()] + z[:, g_idx.long()]).clamp(0, 15)
    return q.long(), z.long(), s


@pytest.fixture(scope="module")
def gptq_pair(checkpoints, tmp_path_factory):
    src = checkpoints["llama"]
    root = tmp_path_factory.mktemp("gptq")
    qdir, ddir = root / "gptq", root / "dense"
    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    perms: dict[tuple[int, str], torch.Tensor] = {}
    qt, dt = {}, {}
    for name, w in tensors.items():
        parts = name.split(".")
        if len(parts) > 3 and parts[-2] in PROJ:
            k = w.shape[1]
            key = (int(parts[2]), "attn" if parts[-2] in PROJ[:3] else "mlp" if parts[-2] in PROJ[4:6] else name)
            if key not in perms:  # one activation order per input (q|k|v share one, gate|up another)
                perms[key] = (torch.arange(k) // GROUP)[torch.randperm(k, generator=gen)].int()
            q, z, s = rtn(w.float(), perms[key])
            prefix = name.removesuffix(".weight")
            qt.update({f"{prefix}.{t}": v for t, v in gptq_tensors(q, z, s, perms[key]).items()})
            dt[name] = dense_weight(q, z, s, perms[key])
        else:
            qt[name] = dt[name] = w
    for d, ts in ((qdir, qt), (ddir, dt)):
        shutil.copytree(src, d)
        save_file({k: v.clone().contiguous() for k, v in ts.items()}, str(d / "model.safetensors"))
    cfg = json.loads((qdir / "config.json").read_text())
    (qdir / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANT}))
    return qdir, ddir


def _load_gptq(source, cfg, reader, dtype, device, max_positions, progress=True, quantization=None, **_):
    """load_model for this checkpoint with the GPTQ formats chosen from its quantization_config."""
    from lamina.models.hf_loader import iter_safetensors
    from lamina.models.loader import _finalize, build_model
    from lamina.models.weight_formats.int4_gptq import choose_gptq
    from lamina.models.weights import load_weights

    model = build_model(cfg, dtype, device, choose_gptq(QUANT, cfg))
    load_weights(model, iter_safetensors(source.path))
    model.init_rope(max_positions)
    return _finalize(model).eval()


def test_gptq_checkpoint_logprobs_match_hf_on_dequantized_copy(gptq_pair, monkeypatch, one_thread):
    from lamina import LLM, SamplingParams
    from lamina.engine import build

    qdir, ddir = gptq_pair
    monkeypatch.setattr(build, "load_model", _load_gptq)
    llm = LLM(str(qdir), dtype="float32", device="cpu", progress=False, kv_cache_memory_gb=0.05)
    layer = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert type(layer.format).__name__ == "GPTQFormat" and layer.__dict__["_perm"] is not None
    ids = [int(i) for i in torch.randint(3, 400, (40,), generator=torch.Generator().manual_seed(2))]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    ref = hf_logprobs(ddir, ids)
    want = torch.tensor([ref[i - 1, ids[i]].item() for i in range(1, len(ids))])
    # the CPU int4 matmul takes bf16 activations: bf16-level agreement, not fp32's
    assert (ours - want).abs().max() < 0.05, (ours - want).abs().max()
