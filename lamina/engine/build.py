"""An LLMEngine's start-up in named steps: load the model, lay out the per-sequence state its layers declare,
allocate the pools, capture decode graphs.

Order matters on CUDA: the state pool and its snapshots are allocated first, then a worst-case step is
profiled, and only then is the KV pool sized, so that its budget sees everything else that lives on the device.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from lamina.cache.block_allocator import BlockAllocator
from lamina.cache.kv_cache import KVCache
from lamina.cache.kv_groups import WindowGroup, mixed_window, window_pool_blocks, windowed_layers
from lamina.cache.sliding_window import release_horizon, window_blocks
from lamina.cache.state_layout import StateLayout
from lamina.cache.state_pool import StatePool
from lamina.cache.state_snapshots import StateSnapshots
from lamina.config import EngineConfig
from lamina.engine.memory import default_num_snapshots, plan_kv_blocks
from lamina.engine.startup import StartupTimer
from lamina.kernels.dispatch import triton_available
from lamina.models.config import ModelConfig
from lamina.models.loader import engine_tokenizer, load_model, read_config, resolve_source

log = logging.getLogger("lamina")


def load_model_and_tokenizer(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                             progress: bool, parallel=None) -> tuple[ModelConfig, Any, torch.nn.Module]:
    """(model config, tokenizer or None, the loaded model with its RoPE table built). parallel: this rank's
    tensor-parallel context (its slice of the model is loaded)."""
    source = resolve_source(config.model)
    model_config, reader = read_config(source)
    tokenizer = engine_tokenizer(config, source)
    max_pos = max(model_config.max_position_embeddings, config.max_model_len or 0)
    model = load_model(source, model_config, reader, dtype, device, max_pos, progress, config.quantization,
                       keep_quantized=not config.dequantize_gguf, parallel=parallel)
    return model_config, tokenizer, model


@dataclass
class Pools:
    """Everything allocated for per-sequence state, bound into the model's layers."""

    layout: StateLayout
    kv_cache: KVCache
    state_pool: StatePool | None  # models whose layers declare recurrent state
    snapshots: StateSnapshots | None  # those, with prefix caching
    max_model_len: int


def build_state_pool(layout: StateLayout, config: EngineConfig, device: torch.device) -> StatePool | None:
    """State slots for every sequence that can run, bound into the layers; None when no layer needs one."""
    if not layout.has_slots:
        return None
    # Speculative decoding leases candidate slots for verify steps from the same pool: K spare ones per sequence
    # that may verify in one step (every running one, or disable_by_batch_size of them). With K spare slots in
    # all, one sequence verified per step and a verify step of a full batch padded every other row to K + 1
    # (the H200's -74% at 64 concurrent). The spare slots come out of the KV budget (sized after this pool).
    spec = config.speculative_config
    spare = 0
    if spec is not None:
        verifying = min(config.max_num_seqs, spec.disable_by_batch_size or config.max_num_seqs)
        spare = spec.num_speculative_tokens * verifying
    pool = StatePool(layout.slot_specs, config.max_num_seqs + spare, device)
    layout.bind_slots(pool.views)
    return pool


def build_snapshots(layout: StateLayout, pool: StatePool | None, config: EngineConfig,
                    device: torch.device, parallel=None) -> StateSnapshots | None:
    """Recurrent-state snapshots for prefix caching of a hybrid model (None otherwise). Tensor-parallel ranks
    use rank 0's snapshot rows, so every rank takes the smallest count any of them would."""
    if not config.enable_prefix_caching or pool is None:
        return None
    n = config.num_state_snapshots
    if n is None:
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        n = default_num_snapshots(config.max_num_seqs, layout.bytes_per_slot(), total)
        if parallel is not None:
            n = parallel.min_int(n, device)
    return StateSnapshots(pool, n, config.state_snapshot_interval, config.block_size)


def step_peak_bytes(model: torch.nn.Module, layout: StateLayout, config: EngineConfig, device: torch.device) -> int:
    """Activation peak of a worst-case step: profiled on CUDA when the KV pool is sized from free memory."""
    if device.type != "cuda" or config.num_kv_blocks is not None or config.kv_cache_memory_gb is not None:
        return 0
    from lamina.engine.profile import profile_peak_bytes

    return profile_peak_bytes(model, layout, config.max_num_batched_tokens, config.max_num_seqs, config.block_size,
                              device)


def build_kv_cache(layout: StateLayout, config: EngineConfig, device: torch.device, peak: int,
                   parallel=None) -> KVCache:
    """The KV pool, sized from the layers' specs and the memory budget, bound into the layers.

    A model mixing sliding-window and full layers (cache/kv_groups.py): the window group's pool gets what its
    sequences can hold at most (window_pool_blocks; never more blocks than the primary pool plus its null
    block), and the primary pool the rest of the budget. An explicit num_kv_blocks counts primary blocks.
    Tensor-parallel ranks share the block tables, so every rank takes the smallest count any of them can hold
    (each rank's blocks hold only its KV heads)."""
    bs = config.block_size
    windowed = windowed_layers(layout.kv_specs)
    if not any(windowed):
        num_blocks = plan_kv_blocks(config, layout.kv_bytes_per_block(bs), device, peak)
        if parallel is not None:
            num_blocks = parallel.min_int(num_blocks, device)
        kv = KVCache(layout.kv_specs, num_blocks, bs, device)
        layout.bind_kv(kv.views)
        return kv
    if parallel is not None:
        raise ValueError("tensor parallelism does not support sliding-window layers next to full ones yet")
    prim = KVCache.bytes_per_block([s for s, w in zip(layout.kv_specs, windowed) if not w], bs)
    win = KVCache.bytes_per_block([s for s, w in zip(layout.kv_specs, windowed) if w], bs)
    need = window_pool_blocks(mixed_window(layout.kv_specs), bs, config.max_num_seqs, config.max_num_batched_tokens)
    shared = plan_kv_blocks(config, prim + win, device, peak)  # the blocks one shared table would get
    num_window = min(need, shared + 1)
    num_blocks = shared
    if config.num_kv_blocks is None:  # the window pool's savings go to the primary pool
        num_blocks = max(1, (shared * (prim + win) - num_window * win) // prim)
    kv = KVCache(layout.kv_specs, num_blocks, bs, device, windowed, num_window)
    layout.bind_kv(kv.views)
    return kv


def build_window_group(layout: StateLayout, kv: KVCache, block_size: int) -> WindowGroup | None:
    """The window group's allocator over its pool (cache/kv_groups.py); None when the model has none."""
    window = mixed_window(layout.kv_specs)
    if window is None:
        return None
    return WindowGroup(BlockAllocator(kv.window_blocks, reserve_null=True), window, block_size)


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig, pool_tokens: int) -> int:
    if config.max_model_len is not None and config.max_model_len > pool_tokens:
        raise ValueError(f"max_model_len {config.max_model_len} does not fit the KV pool ({pool_tokens} tokens)")
    return config.max_model_len or min(model_config.max_position_embeddings, pool_tokens)


def kv_storage_dtype(config: EngineConfig) -> torch.dtype | None:
    """The KV pool's dtype when --kv-cache-dtype overrides the model's (None: the model dtype)."""
    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else None


def build_pools(config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig, dtype: torch.dtype,
                device: torch.device, timer: StartupTimer | None = None, extra_kv_layers: list | None = None,
                parallel=None) -> Pools:
    """extra_kv_layers: a proposer's attention layers that keep their KV in this pool, under the target's block
    tables (the mtp head's): budgeted, allocated and bound with the model's."""
    layout = StateLayout.collect(list(model.state_layers()) + list(extra_kv_layers or []), dtype,
                                 kv_storage_dtype(config))
    state_pool = build_state_pool(layout, config, device)
    snapshots = build_snapshots(layout, state_pool, config, device, parallel)
    peak = step_peak_bytes(model, layout, config, device)
    if timer is not None and peak:
        timer.phase("profiling")
    kv = build_kv_cache(layout, config, device, peak, parallel)
    if timer is not None:
        timer.phase("KV planning")
    pool_tokens = kv.num_blocks * config.block_size
    window = release_horizon(layout.kv_specs)
    if window is not None:  # sliding-window-only: a sequence holds at most its window and one chunk
        per_seq = window_blocks(window, config.max_num_batched_tokens, config.block_size)
        if per_seq <= kv.num_blocks - 1:  # one block is the null block
            pool_tokens = max(pool_tokens, model_config.max_position_embeddings)
    max_model_len = resolve_max_model_len(config, model_config, pool_tokens)
    log.info("KV pool: %d blocks x %d = %d tokens (%.2f GiB%s); step activations profiled at %.2f GiB",
             kv.num_blocks, config.block_size, pool_tokens, kv.nbytes / 2**30,
             f", sliding layers' {kv.window_blocks} blocks included" if kv.window_blocks else "", peak / 2**30)
    return Pools(layout, kv, state_pool, snapshots, max_model_len)


def build_graphs(config: EngineConfig, model: torch.nn.Module, max_model_len: int,
                 state_pool: StatePool | None, device: torch.device, strict: bool = False):
    """Captured CUDA graphs (decode steps and mixed prefill+decode steps), or None (CPU,
    enforce_eager, or state layers without the Triton kernels: the torch references build index tensors from
    host lists, which a graph cannot replay). strict: a failed capture raises (tensor parallelism: every rank
    runs this, collectively, and must end with the same graphs)."""
    if device.type != "cuda" or config.enforce_eager or (state_pool is not None and not triton_available()):
        return None
    from lamina.engine.cuda_graph import CudaGraphRunner

    pad = state_pool.padding_slot if state_pool is not None else None
    # A layer that cannot run a step from device metadata says mixed_graphs = False: such models replay decode
    # graphs only. One whose graph path costs more per token than its eager one (MLA's absorbed prefill rows)
    # caps the mixed graphs' token count (mixed_graph_max_tokens); larger mixed steps run eagerly.
    mixed = None if all(getattr(m, "mixed_graphs", True) for m in model.modules()) else False
    caps = [m.mixed_graph_max_tokens for m in model.modules() if getattr(m, "mixed_graph_max_tokens", None)]
    tokens = min([config.max_num_batched_tokens, *caps])
    # Hybrid models verify drafts in their own graphs (K + 1 rows per sequence, candidate states written).
    from lamina.engine.cuda_graph import verify_graphs_enabled

    spec = config.speculative_config
    width = spec.num_speculative_tokens + 1 if spec is not None and pad is not None and verify_graphs_enabled() else 0
    graphs = CudaGraphRunner(model, config.max_num_seqs, max_model_len, config.block_size, device, pad,
                             tokens, mixed=mixed, verify_width=width)
    graphs.strict = strict
    graphs.capture()
    return graphs

