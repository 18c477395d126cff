"""CUDA graphs for every step: attention-only and hybrid (gated delta net) models alike.

A step of a small model is hundreds of short kernel launches; replaying a captured graph removes the launch
overhead. Which graph a step replays is graph_keys.choose_key: decode-only steps by padded batch size, other
steps (prefill chunks with or without decode rows) by padded token count. The graph reads its inputs from
static buffers (graph_inputs.py pads the batch into them) and computes the backbone's hidden states for all
its rows into one static buffer; the lm_head then runs eagerly on the rows the step needs (one GEMM), so no
graph owns a [rows, vocab] logits tensor (the decode graphs alone held 1.3 GB of them at Qwen3's vocabulary)
and prompt-logprob steps replay graphs too.

Memory: every graph shares one private pool, captured largest first so smaller graphs reuse its blocks;
outputs are views of the one hidden-state buffer, so the pool is about one largest step's activations
(~0.25 GB at 8,192 tokens for the Qwen3-0.6B shape) plus the buffers.

Hybrid models (gated delta net + attention layers, a state pool): the same keys. A decode graph runs the
recurrent decode kernel, a mixed graph the chunked kernels over all its rows (decode rows as one-token
chunks), whose chunk table and conv1d token blocks are built on the device from the padded query starts;
padded sequences use the state pool's padding slot (graph_inputs.py). State snapshots for prefix caching are
copies enqueued after the replay, as after an eager step. Their verify steps (speculative decoding: the state
after every draft position goes to candidate slots) replay verify graphs (graph_keys.verify_keys), the only
graphs that write candidate states; a verify step no verify graph fits runs eagerly (the scheduler gives no
drafts to a hybrid step with a prompt chunk: that ran the torch reference). CUDA_GRAPHS.md has the details.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from lamina.engine.graph_inputs import GraphInputs
from lamina.engine.graph_keys import (
    GraphKey,
    choose_key,
    choose_verify_key,
    decode_batch_sizes,
    graph_keys,
    mixed_token_sizes,
    verify_keys,
)
from lamina.kernels.dispatch import triton_available

log = logging.getLogger("lamina")

# Mixed graphs go up to this many tokens; larger steps run eagerly. They are device-bound (an 8,192-token
# step of the 0.6B shape is ~15 ms of GEMMs against ~5 ms of eager launches, overlapped), while the pool and
# the capture time grow with the largest graph.
MAX_GRAPH_TOKENS = 16384


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Kept for callers of the decode-only API."""
    return decode_batch_sizes(max_num_seqs)


def mixed_graphs_enabled(hybrid: bool = False) -> bool:
    """LAMINA_MIXED_GRAPHS=0 turns the mixed-step graphs off (A/B runs, or a way out if one misbehaves);
    LAMINA_HYBRID_MIXED_GRAPHS=0 turns them off for hybrid models only (their decode graphs stay).

    Hybrid mixed graphs were opt-in for a session: on the Qwen3-Next-80B-A3B shape in bf16, 30 of 48 sequences
    left the run whose mixed steps were eager. No cause was found: the graph body on that shape's structure
    (tests/kernels/test_hybrid_graph_replay.py) equals the eager reference and launches the same kernels for
    every batch composition of a key, and that check counted any token outside eager's top-2 as one eager gives
    no weight to, where 512-expert routing flips on bf16 rounding. scripts/hybrid_graph_check.py settles it in
    fp32 (graphs vs eager, near-tie aware); if it fails on a GPU, flip the default below back to "0"."""
    if os.environ.get("LAMINA_MIXED_GRAPHS", "1") == "0":
        return False
    return not hybrid or os.environ.get("LAMINA_HYBRID_MIXED_GRAPHS", "1") != "0"


def verify_graphs_enabled() -> bool:
    """LAMINA_HYBRID_VERIFY_GRAPHS=0 runs hybrid verify steps eagerly (A/B runs, or a way out)."""
    return os.environ.get("LAMINA_HYBRID_VERIFY_GRAPHS", "1") != "0"


def capture_order(keys: list[GraphKey]) -> list[GraphKey]:
    """Largest first, so smaller graphs reuse the pool's blocks; mixed graphs are the largest. A pure function
    of the keys: tensor-parallel ranks capture (collectively) in this same order (parallel/tp_graphs.py)."""
    return sorted(keys, key=lambda k: (k.tokens, not k.decode, k.verify, k.seqs), reverse=True)


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, padding_slot: int | None = None, max_num_batched_tokens: int | None = None,
                 mixed: bool | None = None, tokens_per_octave: int = 8, verify_width: int = 0,
                 strict: bool = False) -> None:
        """max_num_batched_tokens: the largest step; None or mixed=False capture decode graphs only.
        padding_slot: the state pool's padding slot (hybrid models; None without a state pool).
        mixed=None reads mixed_graphs_enabled().
        verify_width: K + 1 with speculative decoding on a hybrid model (verify graphs), else 0.
        strict: a failed capture raises instead of leaving those steps eager (tensor parallelism: the capture is
        collective, and one rank must not fall back alone)."""
        self.model, self.device, self.strict = model, device, strict
        self.padding_slot = padding_slot
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        mixed = mixed_graphs_enabled(padding_slot is not None) if mixed is None else mixed
        self.decode_sizes = decode_batch_sizes(max_num_seqs)
        # Mixed graphs need the Triton kernels (the torch references plan from host query lengths).
        on = bool(mixed and max_num_batched_tokens) and (device.type != "cuda" or triton_available())
        self.mixed_sizes = mixed_token_sizes(min(max_num_batched_tokens, MAX_GRAPH_TOKENS), tokens_per_octave) \
            if on else []
        self.keys = graph_keys(self.decode_sizes, self.mixed_sizes, max_num_seqs)
        # Dense verify steps replay mixed graphs (attention needs nothing per draft position); hybrid ones need
        # their own, which write the candidate states.
        self.verify_width = verify_width if padding_slot is not None and verify_width >= 2 else 0
        self.keys += verify_keys(self.decode_sizes, self.verify_width)
        max_blocks = (max_model_len + block_size - 1) // block_size
        # Sliding layers bound to the window group's pool (cache/kv_groups.py) read their own tables and slots.
        windowed = any(getattr(getattr(m, "_kv", None), "windowed", False) for m in model.modules())
        self.inputs = GraphInputs(max(k.tokens for k in self.keys), max(k.seqs for k in self.keys), max_blocks,
                                  device, padding_slot, windowed, self.verify_width)
        hidden_size = model.config.hidden_size
        # the compute dtype: the first 16/32-bit float parameter (packed or FP8 weights store other types)
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() >= 2)
        self.hidden = torch.zeros(self.inputs.max_tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.capture_s, self.capture_bytes = 0.0, 0  # set by capture()
        self._pool = None  # the private memory pool all graphs share

    @property
    def state_slots(self) -> torch.Tensor | None:
        return self.inputs.state_slots

    # ---- the captured body (runs eagerly on any device, which is how the CPU tests check it) ---------------
    def body(self, key: GraphKey, exact_host: bool = False) -> torch.Tensor:
        """The backbone over key's padded rows, written into the shared hidden buffer; returns that view."""
        tp = key.tokens
        ctx = self.inputs.context(key, self.max_model_len, exact_host)
        hidden = self.model.hidden_states(self.inputs.input_ids[:tp], self.inputs.positions[:tp], ctx)
        self.hidden[:tp].copy_(hidden)
        return self.hidden[:tp]

    def pick(self, batch) -> GraphKey | None:
        meta, state = batch.ctx.attn, batch.ctx.state
        if state is not None and state.candidate_slots_cpu is not None:  # a hybrid verify step
            key = choose_verify_key(meta.num_seqs, meta.max_query_len, self.decode_sizes, self.verify_width)
            return key if key is not None and self.inputs.fits(batch, key) else None
        key = choose_key(batch.input_ids.shape[0], meta.num_seqs, meta.is_decode_only, self.decode_sizes,
                         self.mixed_sizes, self.max_num_seqs, meta.max_seq_len)
        return key if key is not None and self.inputs.fits(batch, key) else None

    def logits(self, batch, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

    @torch.inference_mode()
    def run_eager(self, batch, key: GraphKey | None = None) -> torch.Tensor:
        """What a replay computes, run without a graph (exact host fields off CUDA, for the reference)."""
        key = key or self.pick(batch)
        self.inputs.load(batch, key)
        return self.logits(batch, self.body(key, exact_host=self.device.type != "cuda"))

    # ---- CUDA --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        self._pool = None
        stream = torch.cuda.Stream(self.device)
        for key in capture_order(self.keys):
            if key.decode:
                self._capture(key, stream)
                continue
            if key.verify:
                if not self.verify_width:
                    continue
                try:
                    self._capture(key, stream)
                except Exception:  # keep serving; hybrid verify steps then run eagerly
                    if self.strict:
                        raise
                    log.exception("capturing the verify graph of %d rows failed: verify steps run eagerly", key.tokens)
                    torch.cuda.synchronize(self.device)
                    self.graphs = {k: g for k, g in self.graphs.items() if not k.verify}
                    self.verify_width, self._pool = 0, None
                continue
            if not self.mixed_sizes:
                continue
            try:
                self._capture(key, stream)
            except Exception:  # keep serving with decode graphs; the log says why
                if self.strict:
                    raise
                log.exception("capturing the mixed-step graph of %d tokens failed: mixed steps run eagerly", key.tokens)
                torch.cuda.synchronize(self.device)
                self.graphs = {k: g for k, g in self.graphs.items() if k.decode}
                self.mixed_sizes, self._pool = [], None
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_reserved(self.device) - before
        log.warning("captured %d CUDA graphs (decode batch sizes %s; mixed token counts %s; verify width %s) in "
                    "%.2f s, %.2f GiB", len(self.graphs), self.decode_sizes, self.mixed_sizes or "none",
                    self.verify_width or "none", self.capture_s, self.capture_bytes / 2**30)

    def _capture(self, key: GraphKey, stream: torch.cuda.Stream) -> None:
        self.inputs.reset(key)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # warm-up: Triton compiles, cuBLAS picks, allocator settles
            for _ in range(2 if key.decode or key.verify else 1):
                self.body(key)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self.body(key)
        self._pool = graph.pool()
        self.graphs[key] = graph

    def can_run(self, batch) -> bool:
        return self.pick(batch) is not None

    @torch.inference_mode()
    def run(self, batch, key: GraphKey | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32, as the eager forward returns them. key: the graph
        to replay (a tensor-parallel worker replays rank 0's choice); None: pick it here."""
        key = key or self.pick(batch)
        self.inputs.load(batch, key)
        self.graphs[key].replay()
        return self.logits(batch, self.hidden)
