"""A Qwen3-shaped DecoderLayer (q/k norm, GQA, SwiGLU) on a decode batch: the fused decode path (norms and SiLU
as GEMV prologues, dense_decode_path.py) against the same layer's separate ops, with the layer's own weights
and KV pool. On a CPU the GEMV's CUDA check is bypassed so the kernels run through Triton's interpreter; the
attention ops keep their torch references either way. fp16: the interpreter computes bf16 dots on raw bits."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, TOL, rel_err

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter; on "
                                "CUDA scripts/gpu_dense_decode_check.py runs the layer on the GPU")


def _layer(act: str):
    from lamina.cache.specs import KVBlocks
    from lamina.models.config import LayerSpec, ModelConfig
    from lamina.models.layers.decoder import DecoderLayer
    from lamina.models.layers.rope_table import RopeTable

    torch.manual_seed(3)
    cfg = ModelConfig(family="t", vocab_size=8, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                      head_dim=16, qk_norm=True, hidden_act=act, layers=[LayerSpec("attention", "dense")])
    rope = RopeTable(16, 10000.0, None)
    rope.build(64, torch.device("cpu"))
    with torch.device("meta"):
        layer = DecoderLayer(cfg, cfg.layers[0], rope)
    layer.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(std=0.2)
            if "norm" in name:
                p.add_(1.0)
    layer = layer.half()
    k = torch.randn(8, 4, 2, 16).half()
    v = torch.randn(8, 4, 2, 16).half()
    layer.self_attn.bind_state(KVBlocks(k, v))
    return layer, k, v


def _ctx(rows: int):
    from lamina.kernels.attention import AttentionMetadata
    from lamina.kernels.metadata import StepContext

    # Up to three decode rows with 5, 2 and 7 tokens of context in 4-token pages; new tokens' slots 4, 9, 22.
    lens = [5, 2, 7][:rows]
    meta = AttentionMetadata(torch.tensor([4, 9, 22][:rows]), torch.arange(rows + 1, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32),
                             torch.tensor([[0, 1], [2, 3], [4, 5]][:rows], dtype=torch.int32),
                             list(range(rows + 1)), lens, 1, max(lens))
    return torch.tensor([4, 1, 6][:rows]), StepContext(meta)


def _run(layer, k, v, x, residual):
    kc, vc = k.clone(), v.clone()
    layer.self_attn._kv.k.copy_(k)
    layer.self_attn._kv.v.copy_(v)
    pos, ctx = _ctx(x.shape[0])
    with torch.no_grad():
        out, res = layer(x, residual, pos, ctx)
    return out, res, layer.self_attn._kv.k.clone(), kc, vc


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_decode_layer_matches_separate_ops(act, first, rows, monkeypatch):
    import lamina.kernels.gemv as gemv_mod
    import lamina.kernels.triton_gemv as tg
    from lamina.kernels.gemv import GemvDispatcher

    monkeypatch.setenv("LAMINA_FUSED_DENSE_DECODE", "1")  # the prologues (the default is the epilogues)
    layer, k, v = _layer(act)
    x = torch.randn(3, 64).half()
    residual = None if first else torch.randn(3, 64).half()
    x, residual = x[:rows], None if first else residual[:rows]
    want, want_res, want_k, _, _ = _run(layer, k, v, x, residual)  # CPU: F.linear and the torch norms

    monkeypatch.setattr(gemv_mod, "use_triton", lambda t: True)
    disp = GemvDispatcher(enabled=True, tune=False)
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        lin.gemv = disp
    kinds: list[str | None] = []
    orig = tg.gemv

    def spy(*args, prologue=None, **kw):
        kinds.append(prologue.kind if prologue is not None else None)
        return orig(*args, prologue=prologue, **kw)

    monkeypatch.setattr(tg, "gemv", spy)
    got, got_res, got_k, _, _ = _run(layer, k, v, x, residual)
    act_kind = "silu" if act == "silu" else "gelu_tanh"
    assert kinds == ["norm" if first else "add_norm", None, "add_norm", act_kind]
    assert rel_err(got, want) < 2 * TOL[torch.float16]
    # the residual after attention: x + residual (exact in the prologue) + the attention output (GEMV o_proj)
    assert rel_err(got_res, want_res) < TOL[torch.float16]
    assert rel_err(got_k, want_k) < TOL[torch.float16]  # the cache got this step's (normalized, rotated) k

    kinds.clear()
    monkeypatch.setenv("LAMINA_FUSED_DENSE_DECODE", "0")
    off, off_res, _, _, _ = _run(layer, k, v, x, residual)
    assert kinds == [None, None, None, None]  # the switch: four plain GEMVs, the norms and SiLU separate
    assert rel_err(off, want) < 2 * TOL[torch.float16] and rel_err(off_res, want_res) < TOL[torch.float16]
    assert rel_err(got, off) < 2 * TOL[torch.float16]


def test_path_declines_cpu_and_other_layers():
    from lamina.models.layers import dense_decode_path

    layer, _, _ = _layer("silu")
    assert not dense_decode_path.applies(layer, torch.randn(1, 64).half())  # no dispatcher, CPU tensor
    assert not dense_decode_path.applies(layer, torch.randn(1, 64).to(DEV).half()) or DEV.type == "cuda"


@pytest.mark.parametrize("mode,want_kinds", [
    ("epi", [None, "epi:add_norm", "epi:act", None]),
    ("pro_in,epi_post,epi_act", ["pro:norm", "epi:add_norm", "epi:act", None]),
    ("epi_act", [None, None, "epi:act", None]),
    ("epi_post,pro_act", [None, "epi:add_norm", None, "pro:act"]),
])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows", [1, 3])
def test_epilogue_modes_match_separate_ops(mode, want_kinds, act, rows, monkeypatch):
    """LAMINA_FUSED_DENSE_DECODE's epilogue fusions (o_proj + add + norm, gate|up + activation), alone and
    mixed with prologues: each GEMV gets the fusion the mode names, and the layer matches the separate ops."""
    import lamina.kernels.gemv as gemv_mod
    import lamina.kernels.triton_gemv as tg
    from lamina.kernels.gemv import GemvDispatcher

    layer, k, v = _layer(act)
    gen = torch.Generator().manual_seed(rows + len(mode))
    x = torch.randn(rows, 64, generator=gen).half()
    residual = torch.randn(rows, 64, generator=gen).half()
    want, want_res, want_k, _, _ = _run(layer, k, v, x, residual)

    monkeypatch.setattr(gemv_mod, "use_triton", lambda t: True)
    monkeypatch.setenv("LAMINA_FUSED_DENSE_DECODE", mode)
    disp = GemvDispatcher(enabled=True, tune=False)
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        lin.gemv = disp
    kinds: list[str | None] = []
    orig = tg.gemv

    def spy(*args, prologue=None, epilogue=None, **kw):
        kinds.append(f"pro:{'act' if prologue.kind in ('silu', 'gelu_tanh') else prologue.kind}" if prologue
                     else f"epi:{'act' if epilogue.kind in ('silu', 'gelu_tanh') else epilogue.kind}" if epilogue
                     else None)
        return orig(*args, prologue=prologue, epilogue=epilogue, **kw)

    monkeypatch.setattr(tg, "gemv", spy)
    got, got_res, got_k, _, _ = _run(layer, k, v, x, residual)
    assert kinds == [k.replace("pro:norm", "pro:add_norm") if k else k for k in want_kinds]
    assert rel_err(got, want) < 2 * TOL[torch.float16]
    assert rel_err(got_res, want_res) < TOL[torch.float16]
    assert rel_err(got_k, want_k) < TOL[torch.float16]


def test_default_fusions_are_the_epilogues(monkeypatch):
    from lamina.models.layers.dense_decode_path import fusions

    monkeypatch.delenv("LAMINA_FUSED_DENSE_DECODE", raising=False)
    assert fusions() == {"epi_post", "epi_act"}
    monkeypatch.setenv("LAMINA_FUSED_DENSE_DECODE", "1")
    assert fusions() == {"pro_in", "pro_post", "pro_act"}


def test_unknown_fusion_name_raises(monkeypatch):
    from lamina.models.layers import dense_decode_path

    monkeypatch.setenv("LAMINA_FUSED_DENSE_DECODE", "pro_in,epi_typo")
    with pytest.raises(ValueError, match="epi_typo"):
        dense_decode_path.fusions()
