"""lamina's side of `lamina bench throughput` and `lamina bench latency`."""
from __future__ import annotations

import time

import torch

from lamina.bench.workload import Workload
from lamina.sampling_params import SamplingParams


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_throughput(llm, wl: Workload, temperature: float = 0.0) -> dict[str, float]:
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
              for n in wl.output_lens]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    warm = prompts[:2]  # warm-up: up to two of the prompts, a few tokens each
    llm.generate(warm, [SamplingParams(max_tokens=4, ignore_eos=True)] * len(warm), use_tqdm=False)
    sync(llm.engine.device)
    load = getattr(llm.engine, "expert_load", None)  # expert parallelism: per-rank routed pairs
    before = load.read(wait=True) if load is not None else None
    sched = llm.engine.scheduler
    preempted = sched.num_preemptions
    start = time.perf_counter()
    with RunningSampler(sched) as running:
        outs = llm.generate(prompts, params, use_tqdm=True)
        sync(llm.engine.device)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(wl.output_lens), "every request must produce exactly its output length"
    result = {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed,
              "total_tok_s": (out_tokens + wl.num_prompt_tokens) / elapsed,
              # What the KV pool admitted: its size in tokens, the batch it allowed step by step, and the
              # sequences it had to evict (recomputed later) when decode outgrew it.
              "kv_token_capacity": llm.engine.allocator.num_blocks * llm.engine.config.block_size,
              "mean_running": running.mean, "max_running": running.max, "num_steps": running.steps,
              "num_preemptions": sched.num_preemptions - preempted}
    if load is not None:
        routed = [a - b for a, b in zip(load.read(wait=True), before)]
        result["expert_parallel_routed_tokens"] = routed  # the run's pairs per rank, and max / mean of them
        result["expert_parallel_imbalance"] = max(routed) * len(routed) / max(1, sum(routed))
    return result


class RunningSampler:
    """Counts the scheduler's running sequences at every schedule() (the batch each step ran), by wrapping
    that one scheduler instance's method for the duration of a `with` block."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.steps, self.total, self.max = scheduler, 0, 0, 0

    def __enter__(self) -> RunningSampler:
        inner = self.scheduler.schedule

        def schedule(*args, **kwargs):
            out = inner(*args, **kwargs)
            n = len(self.scheduler.running)
            self.steps, self.total, self.max = self.steps + 1, self.total + n, max(self.max, n)
            return out

        self.scheduler.schedule = schedule
        return self

    def __exit__(self, *exc) -> None:
        del self.scheduler.schedule  # the class's method again

    @property
    def mean(self) -> float:
        return self.total / max(1, self.steps)


def run_latency(llm, prompt: list[int], output_len: int, repeats: int = 3) -> dict[str, float]:
    """Single request: time to first token and decode tokens/s (median of repeats)."""
    eng = llm.engine
    eng.stream_outputs = True  # every step's output, to see the first token arrive
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ttfts, decode_rates = [], []
    for r in range(repeats + 1):
        rid = f"lat-{r}"
        sync(eng.device)
        start = time.perf_counter()
        # A different first token each repeat, so the prefix cache cannot serve the prompt.
        eng.add_request(rid, {"prompt_token_ids": [prompt[0] + r + 1] + prompt[1:]}, params)
        first = None
        while eng.has_unfinished_requests():
            for out in eng.step():
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
        sync(eng.device)
        end = time.perf_counter()
        if r == 0:
            continue  # warm-up (and CUDA graph capture)
        ttfts.append(first - start)
        decode_rates.append((output_len - 1) / (end - first))
    ttfts.sort(), decode_rates.sort()
    return {"ttft_s": ttfts[len(ttfts) // 2], "decode_tok_s": decode_rates[len(decode_rates) // 2]}


def _expert_params(model: torch.nn.Module) -> dict[int, float]:
    """id(param) -> the fraction of it one token reads: top_k / num_experts for stacked expert weights."""
    from lamina.models.layers.moe import SparseMoE
    from lamina.models.layers.relu2_moe import Relu2MoE

    frac: dict[int, float] = {}
    for m in model.modules():
        if isinstance(m, (SparseMoE, Relu2MoE)):
            for p in m.experts.parameters():
                frac[id(p)] = m.experts_per_token / m.experts.num_experts
    return frac


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step of one sequence reads: every parameter but the embedding table (one
    row is read), and of stacked MoE experts only the top_k a token is routed to."""
    embed = model.model.embed_tokens.weight
    frac = _expert_params(model)
    total = sum(p.numel() * p.element_size() * frac.get(id(p), 1.0) for p in model.parameters() if p is not embed)
    # Packed weight formats keep their scales as buffers, read with the weights.
    tied = model.lm_head.weight is embed
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(("_scales", "_offsets"))
                 and (tied or not n.startswith("model.embed_tokens.")))
    if tied:  # the table is read whole by lm_head
        total += embed.numel() * embed.element_size()
    return int(total)


def state_bytes_per_token(model: torch.nn.Module, context_len: int, kv_dtype: torch.dtype | None = None) -> int:
    """Bytes of per-sequence state one decode step reads or writes: the recurrent and conv states of the
    state layers (read and written back), and the KV cache of the attention layers at context_len (a
    sliding-window layer reads at most its window; in kv_dtype when the pool's differs from the model's,
    --kv-cache-dtype)."""
    from lamina.cache.specs import SlidingWindowSpec
    from lamina.cache.state_layout import StateLayout

    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() >= 2)
    layout = StateLayout.collect(model.state_layers(), dtype, kv_dtype)  # the compute dtype, not a packed weight's
    state = 2 * layout.bytes_per_slot()
    kv = sum(s.bytes_per_block(1) * (min(context_len, s.window) if isinstance(s, SlidingWindowSpec) else context_len)
             for s in layout.kv_specs)
    return state + kv


def active_params_per_token(model: torch.nn.Module) -> float:
    """Parameters one token multiplies by (all but the embedding table, top_k of the experts)."""
    embed = model.model.embed_tokens.weight
    frac = _expert_params(model)
    n = sum(p.numel() * frac.get(id(p), 1.0) for p in model.parameters() if p is not embed)
    return n + (embed.numel() if model.lm_head.weight is embed else 0)


def copy_bandwidth(device: torch.device) -> float:
    """Measured device copy bandwidth in bytes/s (bytes read + written), the roofline's ceiling."""
    n = (1 << 30) if device.type == "cuda" else (1 << 27)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps = 20 if device.type == "cuda" else 5
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - start)
