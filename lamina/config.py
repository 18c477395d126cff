"""Engine settings."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.spec.config import parse_speculative_config


@dataclass
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.90
    kv_cache_memory_gb: float | None = None  # explicit KV budget; default on CPU: 2 GiB
    num_kv_blocks: int | None = None  # exact pool size (tests)
    seed: int = 0
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    # Read sampled tokens back one step late so host work overlaps device work. Default: on for CUDA; on the
    # CPU there is nothing to overlap and it would only delay each token by a step.
    async_scheduling: bool | None = None
    # Hybrid models: recurrent-state snapshots for prefix caching (rows allocated once; None: 2 * max_num_seqs,
    # capped at 10% of device memory) and the spacing of the periodic ones in tokens (a multiple of block_size).
    num_state_snapshots: int | None = None
    state_snapshot_interval: int = 256
    tokenizer: str | None = None  # a tokenizer directory other than the model's
    # No tokenizer at all (vLLM's flag): prompts and outputs are token ids only, as for random: models.
    skip_tokenizer_init: bool = False
    # Dummy requests through the step loop at start-up, so the first requests pay no Triton compilation
    # (engine/warmup.py). Default: on for CUDA.
    warmup: bool | None = None
    # Speculative decoding, as vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": 3, ...}
    # (a dict or its JSON; checked here, see lamina/spec/config.py). None: off.
    speculative_config: Any = None
    quantization: str | None = None  # online weight quantization of a dense checkpoint: "fp8"
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8" (e4m3, per-tensor scale 1.0)
    # GGUF: dequantize every tensor at load (default: the supported block types stay packed).
    dequantize_gguf: bool = False
    # Tensor parallelism: the model split over this many processes (one per GPU; lamina/parallel/). 1: one
    # process, no collectives.
    tensor_parallel_size: int = 1
    # How the tensor-parallel workers start: "mp" (torch.multiprocessing on this host) or "ray" (actors of a
    # Ray cluster, possibly on other nodes; lamina/parallel/ray_workers.py).
    distributed_executor_backend: str = "mp"
    # Expert parallelism (with tensor_parallel_size > 1): MoE layers place whole experts across the ranks
    # instead of splitting each one (lamina/parallel/expert_parallel.py); ignored for models without experts.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"unsupported quantization {self.quantization!r}; supported: fp8")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; supported: auto, fp8")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"unsupported distributed_executor_backend {self.distributed_executor_backend!r}; "
                             "supported: mp, ray")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
