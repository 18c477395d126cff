"""State specs: the pools are sized from what the layers declare (equal to the sizes computed from the config
alone, the old way), layers are bound through the explicit API, and snapshot / restore / copy-slot work for
any declared recurrent state."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from lamina.cache.kv_cache import KVCache
from lamina.cache.specs import (
    FullAttentionSpec,
    KVBlocks,
    LatentAttentionSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    SlotRows,
    StateTensor,
)
from lamina.cache.state_layout import StateLayout
from lamina.cache.state_pool import StatePool
from lamina.cache.state_snapshots import StateSnapshots
from lamina.models.config import KV_MIXERS
from lamina.models.model import CausalLM
from lamina.models.presets import PRESETS, preset_config
from lamina.models.registry import config_from_hf

LAMINA = Path(__file__).resolve().parent.parent / "lamina"


def meta_model(preset: str) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(config_from_hf(preset_config(preset)))


def old_kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
    """The KV pool's bytes per block as computed before state specs: K and V of every attention layer."""
    item = torch.empty((), dtype=dtype).element_size()
    n_attn = sum(1 for s in cfg.layers if s.mixer in KV_MIXERS)
    # MLA layers (DeepSeek presets) keep one latent + rope-key row per token instead of K and V.
    n_mla = sum(1 for s in cfg.layers if s.mixer == "mla")
    latent = n_mla * block_size * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * item if n_mla else 0
    return n_attn * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * item + latent


def old_bytes_per_slot(cfg, dtype: torch.dtype) -> int:
    """The state pool's bytes per slot before specs: conv window in the model dtype + fp32 recurrent state."""
    item = torch.empty((), dtype=dtype).element_size()
    g, m = cfg.gdn, cfg.mamba2
    n = sum(1 for s in cfg.layers if s.mixer == "gated_delta_net")
    n_mamba = sum(1 for s in cfg.layers if s.mixer == "mamba2")  # Mamba-2: conv window + fp32 [H, P, N]
    total = n_mamba * (m.conv_dim * (m.conv_kernel - 1) * item + m.num_heads * m.head_dim * m.state_size * 4) \
        if n_mamba else 0
    if n:
        total += n * (g.conv_dim * (g.conv_kernel - 1) * item + g.num_v_heads * g.head_k_dim * g.head_v_dim * 4)
    return total


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sizes_from_specs_equal_the_old_sizes(preset, dtype):
    model = meta_model(preset)
    layout = StateLayout.collect(model.state_layers(), dtype)
    for bs in (1, 16):
        assert layout.kv_bytes_per_block(bs) == old_kv_bytes_per_block(model.config, bs, dtype) > 0
    assert layout.bytes_per_slot() == old_bytes_per_slot(model.config, dtype)
    assert layout.has_slots == (model.config.gdn is not None or model.config.mamba2 is not None)


def test_qwen3_next_spec_shapes_and_dtypes():
    model = meta_model("tiny-qwen3-next")
    layout = StateLayout.collect(model.state_layers(), torch.bfloat16)
    g = model.config.gdn
    assert len(layout.kv_specs) == 1 and len(layout.slot_specs) == 3
    assert layout.kv_specs[0] == FullAttentionSpec(model.config.num_kv_heads, model.config.head_dim, torch.bfloat16)
    conv, ssm = layout.slot_specs[0].tensors
    assert conv == StateTensor("conv", (g.conv_dim, g.conv_kernel - 1), torch.bfloat16)
    assert ssm == StateTensor("ssm", (g.num_v_heads, g.head_k_dim, g.head_v_dim), torch.float32)


def test_sliding_window_layers_declare_their_window():
    cfg = config_from_hf(dict(preset_config("tiny-llama"), architectures=["MistralForCausalLM"], sliding_window=12))
    with torch.device("meta"):
        model = CausalLM(cfg)
    specs = StateLayout.collect(model.state_layers(), torch.float16).kv_specs
    assert specs and all(s == SlidingWindowSpec(cfg.num_kv_heads, cfg.head_dim, torch.float16, 12) for s in specs)
    # Laid out like full attention (freeing out-of-window blocks is not done yet).
    assert specs[0].bytes_per_block(16) == FullAttentionSpec(cfg.num_kv_heads, cfg.head_dim,
                                                             torch.float16).bytes_per_block(16)


def test_latent_spec_allocates_one_tensor():
    spec = LatentAttentionSpec(latent_dim=64, rope_dim=16, dtype=torch.float16)
    view = KVCache([spec], 3, 4, torch.device("cpu")).views[0]
    assert view.kv.shape == (3, 4, 80) and view.kv.dtype == torch.float16
    assert spec.bytes_per_block(4) == 4 * 80 * 2


class ToyState(nn.Module):
    """A layer with a made-up recurrent state: any number of named tensors, any shapes and dtypes."""

    def __init__(self, spec: RecurrentStateSpec | None) -> None:
        super().__init__()
        self.spec, self.view = spec, None

    def state_spec(self, dtype: torch.dtype):
        return self.spec

    def bind_state(self, view: SlotRows) -> None:
        self.view = view


def toy_specs() -> list[RecurrentStateSpec]:
    return [RecurrentStateSpec((StateTensor("a", (3,), torch.float16), StateTensor("b", (2, 5), torch.float32),
                                StateTensor("c", (), torch.int32))),
            RecurrentStateSpec((StateTensor("only", (4, 2, 3), torch.bfloat16),))]


def fill_random(pool: StatePool, gen: torch.Generator) -> None:
    for view in pool.views:
        for t in view.tensors.values():
            t.copy_(torch.randint(-1000, 1000, t.shape, generator=gen).to(t.dtype))


def slot(pool: StatePool, s: int) -> list[torch.Tensor]:
    return [t[s].clone() for view in pool.views for t in view.tensors.values()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_layout_binds_any_declared_state_and_skips_stateless_layers():
    layers = [ToyState(s) for s in toy_specs()] + [ToyState(None)]
    layout = StateLayout.collect(layers, torch.float32)
    assert layout.slot_layers == layers[:2] and not layout.kv_specs
    pool = StatePool(layout.slot_specs, 4, torch.device("cpu"))
    layout.bind_slots(pool.views)
    assert [layer.view for layer in layers] == [*pool.views, None]
    assert pool.views[0]["b"].shape == (5, 2, 5) and pool.views[0]["c"].dtype == torch.int32  # 4 + padding slot
    assert layout.bytes_per_slot() == (3 * 2 + 10 * 4 + 4) + 24 * 2
    with pytest.raises(ValueError):
        layout.bind_slots(pool.views[:1])


def test_snapshot_restore_and_copy_slot_round_trip_any_declared_tensors():
    gen = torch.Generator().manual_seed(0)
    pool = StatePool(toy_specs(), 4, torch.device("cpu"))
    snaps = StateSnapshots(pool, 2, interval=4, block_size=4)
    fill_random(pool, gen)
    saved = slot(pool, 1)
    snaps.save(1, b"h1", 4, lambda h: True)
    fill_random(pool, gen)  # the live slots move on; the snapshot must not
    others = [slot(pool, s) for s in (0, 1, 3, 4)]
    snaps.restore(snaps.lookup(b"h1"), 2)
    assert same(slot(pool, 2), saved)
    assert all(same(slot(pool, s), o) for s, o in zip((0, 1, 3, 4), others))  # nothing else was written
    # Candidate states for speculative decoding: fork slot 2 into slots 0 and 3, then let them diverge.
    pool.copy_slot(2, 0)
    pool.copy_slot(2, 3)
    assert same(slot(pool, 0), saved) and same(slot(pool, 3), saved)
    pool.views[1]["only"][3].add_(1)
    assert same(slot(pool, 0), saved) and not same(slot(pool, 3), saved)
    assert snaps.num_used + snaps.num_free == snaps.num_snapshots


def test_kv_views_and_rebinding_to_empty_views():
    spec = FullAttentionSpec(2, 8, torch.float32)
    layout = StateLayout.collect([ToyKV(spec), ToyKV(spec)], torch.float32)
    scratch = KVCache(layout.kv_specs, 5, 4, torch.device("cpu"))
    layout.bind_kv(scratch.views)
    assert all(layer.view is v for layer, v in zip(layout.kv_layers, scratch.views, strict=True))
    assert scratch.views[0].k.shape == (5, 4, 2, 8) and scratch.nbytes == 5 * 2 * spec.bytes_per_block(4)
    layout.bind_kv(KVCache(layout.kv_specs, 0, 4, torch.device("cpu")).views)  # what profiling does after its pass
    assert all(layer.view.k.numel() == 0 for layer in layout.kv_layers)


class ToyKV(nn.Module):
    def __init__(self, spec: FullAttentionSpec) -> None:
        super().__init__()
        self.spec, self.view = spec, None

    def state_spec(self, dtype: torch.dtype):
        return self.spec

    def bind_state(self, view: KVBlocks) -> None:
        self.view = view


def test_engine_binds_the_pools_it_allocated():
    from lamina import LLM

    llm = LLM(model="random:tiny-qwen3-next", dtype="float32", device="cpu", block_size=4, num_kv_blocks=16,
              max_num_seqs=3, max_model_len=64, progress=False, enable_prefix_caching=True, num_state_snapshots=2)
    eng = llm.engine
    layout = eng.state_layout
    assert layout.kv_layers and all(v.k is m.k_cache and v.v is m.v_cache
                                    for v, m in zip(eng.kv_cache.views, layout.kv_layers, strict=True))
    assert layout.slot_layers and all(v["ssm"] is m.ssm_state and v["conv"] is m.conv_state
                                      for v, m in zip(eng.state_pool.views, layout.slot_layers, strict=True))
    assert all(v["conv"].shape[0] == 4 for v in eng.state_pool.views)  # 3 slots + the padding slot
    assert eng.state_pool.padding_slot == 3
    assert [v["ssm"].shape[1:] for v in eng.snapshots.views] == [v["ssm"].shape[1:] for v in eng.state_pool.views]


def test_cache_and_engine_find_no_layer_classes():
    """The pools know specs, not layers: no isinstance on layer classes, no imports of lamina.models in cache."""
    layer_classes = {"Attention", "AttentionBase", "GatedAttention", "GatedDeltaNet", "DecoderLayer", "SparseMoE"}
    for sub in ("cache", "engine"):
        for path in (LAMINA / sub).glob("*.py"):
            src = path.read_text()
            for m in re.finditer(r"isinstance\([^,]+,\s*\(?([\w., ]+)", src):
                names = {n.strip().split(".")[-1] for n in m.group(1).split(",")}
                assert not names & layer_classes, f"{path.name}: {m.group(0)}"
    for path in (LAMINA / "cache").glob("*.py"):
        assert not re.search(r"^\s*(from|import) lamina\.(models|engine)", path.read_text(), re.MULTILINE), path.name


def test_profiling_binds_scratch_kv_then_empty_views(monkeypatch):
    """engine/profile.py's bind flow, on the CPU with the CUDA memory counters stubbed out."""
    from lamina import LLM, SamplingParams
    from lamina.engine.profile import profile_peak_bytes

    llm = LLM(model="random:tiny-qwen3-next", dtype="float32", device="cpu", block_size=4, num_kv_blocks=16,
              max_num_seqs=2, max_model_len=64, progress=False)
    eng = llm.engine
    layout = eng.state_layout
    prompt = {"prompt_token_ids": list(range(100, 120))}
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    seen = []
    real = eng.model.forward

    def spy(*args, **kwargs):
        seen.append([m.k_cache.shape[0] for m in layout.kv_layers])
        return real(*args, **kwargs)

    monkeypatch.setattr(eng.model, "forward", spy)
    profile_peak_bytes(eng.model, layout, 30, 2, 4, torch.device("cpu"))
    assert seen == [[8] * len(layout.kv_layers)]  # scratch: ceil(30 / 4) blocks during the pass
    assert all(m.k_cache.shape[0] == 0 for m in layout.kv_layers)  # none kept afterwards
    monkeypatch.setattr(eng.model, "forward", real)
    layout.bind_kv(eng.kv_cache.views)  # what the engine does next: the real pool, through the same call
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == before
