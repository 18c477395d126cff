"""HF transformers on the same workload: the baseline every lamina figure is compared with."""
from __future__ import annotations

import time

import torch

from lamina.bench.workload import Workload


def load_hf(model: str, dtype: torch.dtype, device: torch.device, attn: str):
    import transformers

    from lamina.models.loader import resolve_source

    src = resolve_source(model)
    kw = dict(dtype=dtype, attn_implementation=attn)
    if src.kind == "random":
        from lamina.bench.checkpoint import random_hf_config

        cfg = random_hf_config(src.preset, str(dtype).removeprefix("torch."))
        with torch.device(device):
            m = transformers.AutoModelForCausalLM.from_config(cfg, **kw)
    elif src.kind == "gguf":
        m = transformers.AutoModelForCausalLM.from_pretrained(str(src.path.parent), gguf_file=src.path.name, **kw)
    else:
        m = transformers.AutoModelForCausalLM.from_pretrained(str(src.path), **kw)
    return m.to(device).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def hf_generate_padded(model, wl: Workload, batch_size: int, device: torch.device) -> tuple[float, int]:
    """Static batches with left padding (plain `generate`); returns (elapsed seconds, tokens generated: every
    row of a batch runs to the batch's longest output)."""
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(wl.prompts), batch_size):
        chunk = wl.prompts[i:i + batch_size]
        n_out = max(wl.output_lens[i:i + batch_size])
        generated += n_out * len(chunk)
        width = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=n_out,
                       min_new_tokens=n_out, do_sample=False, pad_token_id=0)
    _sync(device)
    return time.perf_counter() - start, generated


def hf_generate_batch(model, wl: Workload, device: torch.device, max_batch_tokens: int | None = None) -> float:
    """HF's continuous batching (`generate_batch`, paged KV); returns elapsed seconds."""
    from transformers import GenerationConfig

    n_out = max(wl.output_lens)
    cfg = GenerationConfig(max_new_tokens=n_out, do_sample=False, eos_token_id=-1, pad_token_id=0,
                           use_cuda_graph=False, **({"max_batch_tokens": max_batch_tokens} if max_batch_tokens else {}))
    # No inference_mode here: generate_batch updates its static tensors in place from a worker thread.
    start = time.perf_counter()
    model.generate_batch(inputs=wl.prompts, generation_config=cfg, progress_bar=True)
    _sync(device)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_latency(model, prompt: list[int], output_len: int, device: torch.device, **generate_kw) -> dict[str, float]:
    """Batch-1 TTFT and decode rate of plain `generate` (its default cache; generate_kw: e.g. a static one)."""
    ids = torch.tensor([prompt], device=device)
    kw = {"do_sample": False, "pad_token_id": 0, **generate_kw}
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
    _sync(device)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    _sync(device)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
    _sync(device)
    total = time.perf_counter() - start
    return {"ttft_s": ttft, "decode_tok_s": (output_len - 1) / max(total - ttft, 1e-9)}


def hf_latency_compiled(model, prompt: list[int], output_len: int, device: torch.device,
                        repeats: int = 2) -> dict[str, float]:
    """HF's fastest single-request path that needs no extra install: a static KV cache and the decode forward
    compiled by torch.compile (mode reduce-overhead: CUDA graphs), as `generate` does when given
    cache_implementation="static" and a CompileConfig. The prefill runs uncompiled (HF compiles only the
    one-token steps). Warm-up runs the same lengths first (compilation, graph recording); the static cache is
    sized prompt + output_len, so each timed call replays the same compiled graph."""
    from transformers import CompileConfig

    ids = torch.tensor([prompt], device=device)
    kw = {"do_sample": False, "pad_token_id": 0, "cache_implementation": "static",
          "compile_config": CompileConfig(fullgraph=True, mode="reduce-overhead")}

    def run(n: int) -> float:
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():  # not inference_mode: cudagraph-tree recording wants ordinary tensors
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        _sync(device)
        return time.perf_counter() - start

    for _ in range(3):  # compile, then let the CUDA-graph trees record and settle
        run(output_len)
    run(1)
    ttft = sorted(run(1) for _ in range(repeats))[repeats // 2]
    total = sorted(run(output_len) for _ in range(repeats))[repeats // 2]
    # HF compiles only on accelerators; `_compiled_call` is where generate keeps the compiled forward.
    return {"ttft_s": ttft, "decode_tok_s": (output_len - 1) / max(total - ttft, 1e-9),
            "mode": "static cache + torch.compile(reduce-overhead, fullgraph)",
            "compiled": hasattr(model, "_compiled_call")}
