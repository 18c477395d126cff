#!/usr/bin/env python3
"""One stage of scripts/gpu_families_bench.py (issue 17's H200 figures), run as its own process.

  parity PRESET   the preset cut to a few layers (CUT below: every layer kind of the family is in them), random
                  bf16 weights saved as an HF checkpoint; lamina (bf16, CUDA graphs on) and HF transformers
                  (fp32, eager) score the same token ids: max / mean |delta logprob| over every position and
                  greedy agreement, through lamina.verify's compare() and bf16 tolerances. Prompts are long
                  enough, and lamina's chunks short enough, to cut inside sliding windows and scan chunks.
  bench PRESET    the full preset (random:PRESET, bf16), the same figures as `lamina bench latency --baseline hf`
                  and `lamina bench throughput --baseline hf --hf-mode generate --hf-batch-size 64`, from one
                  engine and one HF model (the same library functions; two CLI runs would load each twice):
                  batch-1 decode tok/s with the % of the HBM roofline on the bytes one decode step reads, and
                  64-concurrent throughput; HF batch 1 with a static cache (eager) where the family supports it,
                  and with its default dynamic cache, and HF batch 64 padded `generate`.

Bytes per decoded token (lamina.bench.offline, as `lamina bench latency` counts them): every weight once (the
embedding table one row, tied lm_head whole), of stacked MoE experts only top_k / num_experts (the active
experts; shared experts whole), plus the sequence's state: KV of each attention layer at the mean decode
context (a sliding-window layer at most its window; MLA its latent + rope dims), recurrent/conv states read and
written. The roofline is the measured device copy bandwidth. Both sides get the same random weights only in
the parity stage: speed does not depend on the weight values, so the bench stage's HF model is a fresh
random init of the same config.

    python scripts/families_stage.py parity gemma3-4b --json out.json
    python scripts/families_stage.py bench deepseek-v2-lite --smoke   # CPU, toy widths: the code paths only
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Cut presets for parity: enough layers for each kind (Gemma 3: five sliding + the first global layer;
# Nemotron-H: Mamba-2, MLP and the first attention block; DeepSeek-V2-Lite: the dense layer and two MoE ones).
CUT = {"gemma3-4b": dict(num_hidden_layers=6),
       "nemotron-h-8b": dict(num_hidden_layers=9, hybrid_override_pattern="M-M-M-M*-"),
       "deepseek-v2-lite": dict(num_hidden_layers=3)}
# (prompt lengths, lamina's max_num_batched_tokens): past Gemma's 1024 window and cut inside it, across
# Nemotron's 128-token scan chunks, MLA's expanded prefill in several chunks.
PARITY_SHAPES = {"gemma3-4b": ([1200, 300], 448), "nemotron-h-8b": ([300, 77], 100),
                 "deepseek-v2-lite": ([200, 50], 64)}
# --smoke (CPU, fp32): toy widths of the same layer layouts, so every call here runs before a GPU call does.
SMOKE = {"gemma3-4b": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=16),
         "nemotron-h-8b": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=32, mamba_num_heads=4, mamba_head_dim=16,
                               ssm_state_size=16, n_groups=2, chunk_size=16, num_hidden_layers=9,
                               hybrid_override_pattern="M-M-M-M*-"),
         "deepseek-v2-lite": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                  num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=16,
                                  qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                                  num_hidden_layers=3)}
SMOKE_SHAPES = ([40, 21], 7)


def _register(preset: str, suffix: str, **overrides) -> str:
    from lamina.models import presets

    name = f"{preset}-{suffix}"
    presets.PRESETS[name] = dict(presets.PRESETS[preset], **overrides)
    return name


def _save_random(preset: str, out: Path, device: torch.device) -> Path:
    """The preset's HF model with HF's random init, in bf16, built on the device (fast on a GPU) and saved."""
    import transformers

    from lamina.bench.checkpoint import random_hf_config

    torch.manual_seed(0)
    with device:
        model = transformers.AutoModelForCausalLM.from_config(random_hf_config(preset), dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    _empty_cache(device)
    _save_id_tokenizer(out)
    return out


def _save_id_tokenizer(out: Path) -> None:
    """A one-word tokenizer: the engine loads one from an HF directory, and these runs take token ids only."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parity(preset: str, device: torch.device, dtype: str = "bfloat16", smoke: bool = False,
           max_tokens: int = 8) -> dict:
    from lamina import LLM, SamplingParams
    from lamina.bench.workload import make_workload
    from lamina.verify import compare, load_hf, tolerances

    lens, chunk = SMOKE_SHAPES if smoke else PARITY_SHAPES[preset]
    name = _register(preset, "cut", **{**CUT[preset], **(SMOKE[preset] if smoke else {})})
    res: dict = {"preset": name, "cut": CUT[preset], "max_num_batched_tokens": chunk, "dtype": dtype}
    with tempfile.TemporaryDirectory() as tmp:
        path = _save_random(name, Path(tmp) / name, device)
        llm = LLM(model=str(path), dtype=dtype, device=device.type, progress=False, enable_prefix_caching=False,
                  max_num_batched_tokens=chunk, max_num_seqs=8)
        vocab = llm.engine.model_config.vocab_size
        prompts = [make_workload(1, (n, n), (1, 1), vocab, seed=i).prompts[0] for i, n in enumerate(lens)]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, prompt_logprobs=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs = []
        for p, out in zip(prompts, outs):
            gen = out.outputs[0]
            lps = [out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
            lps += [gen.logprobs[i][t].logprob for i, t in enumerate(gen.token_ids)]
            runs.append((p + list(gen.token_ids), lps, len(gen.token_ids)))
        res["window_group"] = llm.engine.window_group is not None
        res["graphs"] = llm.engine.runner.graphs is not None
        del llm, outs
        _empty_cache(device)
        hf = load_hf(str(path), device.type)
        max_tol, mean_tol = tolerances(dtype, None, None)
        rows = [compare(f"{len(p)} tokens", hf, ids, lps, n, device.type, max_tol, mean_tol)
                for p, (ids, lps, n) in zip(prompts, runs)]
    res["prompts"] = [vars(r) for r in rows]
    res["passed"] = all(r.passed for r in rows)
    return res


def hf_static_latency(model, prompt: list[int], output_len: int, device: torch.device) -> dict:
    """HF batch 1 with a static cache, eager (torch.compile off: its compile time does not fit the call);
    the error when the family's cache cannot be static."""
    from lamina.bench.hf_baseline import hf_latency

    try:
        return hf_latency(model, prompt, output_len, device, cache_implementation="static", disable_compile=True)
    except Exception as exc:  # e.g. a hybrid Mamba cache: no static form
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def bench(preset: str, input_len: int, output_len: int, concurrency: int, device: torch.device,
          dtype: str = "bfloat16", smoke: bool = False) -> dict:
    from lamina import LLM
    from lamina.bench.common import free_device
    from lamina.bench.hf_baseline import hf_generate_padded, hf_latency, load_hf
    from lamina.bench.offline import (
        copy_bandwidth,
        run_latency,
        run_throughput,
        state_bytes_per_token,
        weight_bytes_per_token,
    )
    from lamina.bench.workload import make_workload

    dev = device
    model = f"random:{_register(preset, 'smoke', **SMOKE[preset]) if smoke else preset}"
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, device=dev.type, progress=False, max_num_seqs=concurrency,
              enable_prefix_caching=False)
    eng = llm.engine
    res: dict = {"preset": preset, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                 "dtype": dtype, "startup_s": time.perf_counter() - t0,
                 "graphs": eng.runner.graphs is not None, "window_group": eng.window_group is not None}
    vocab = eng.model_config.vocab_size
    prompt = make_workload(1, (input_len,) * 2, (output_len,) * 2, vocab, seed=1).prompts[0]
    wl = make_workload(concurrency, (input_len,) * 2, (output_len,) * 2, vocab)
    lat = run_latency(llm, prompt, output_len, repeats=2)
    wbytes = weight_bytes_per_token(eng.model)
    sbytes = state_bytes_per_token(eng.model, input_len + output_len // 2)
    bw = copy_bandwidth(dev)
    step_bytes = wbytes + sbytes

    def roofline(tok_s: float) -> float:
        return step_bytes * tok_s / bw

    res["bytes_per_token"] = {"weights": wbytes, "state": sbytes, "copy_bandwidth_GBs": bw / 1e9,
                              "roofline_tok_s": bw / step_bytes}
    res["lamina"] = {"batch1": {**lat, "roofline_frac": roofline(lat["decode_tok_s"])},
                     f"concurrent{concurrency}": run_throughput(llm, wl)}
    del llm, eng
    free_device(dev)
    hf = load_hf(model, getattr(torch, dtype), dev, "sdpa")
    dyn = hf_latency(hf, prompt, output_len, dev)
    static = hf_static_latency(hf, prompt, output_len, dev)
    res["hf"] = {"batch1_dynamic": {**dyn, "roofline_frac": roofline(dyn["decode_tok_s"])},
                 "batch1_static": {**static, **({"roofline_frac": roofline(static["decode_tok_s"])}
                                                if "decode_tok_s" in static else {})}}
    # HF's torch fallback for the Mamba-2 scan materializes (batch, chunks, L, L, groups, state): 64 GiB at
    # batch 64 on Nemotron-H 8B (seen on the H200), so the baseline halves its batch until it fits and says so.
    hf_batch = concurrency
    while True:
        try:
            elapsed, generated = hf_generate_padded(hf, wl, hf_batch, dev)
            break
        except torch.OutOfMemoryError:
            free_device(dev)
            if hf_batch == 1:
                raise
            hf_batch //= 2
    useful = sum(wl.output_lens)
    res["hf"][f"concurrent{concurrency}"] = {"mode": "generate (padded)", "hf_batch_size": hf_batch,
                                             "elapsed_s": elapsed, "output_tok_s": useful / elapsed,
                                             "generated_tokens": generated}
    best_hf = max(v["decode_tok_s"] for v in (dyn, static) if "decode_tok_s" in v)
    res["ratio_batch1"] = lat["decode_tok_s"] / best_hf
    res["ratio_concurrent"] = (res["lamina"][f"concurrent{concurrency}"]["output_tok_s"]
                               / res["hf"][f"concurrent{concurrency}"]["output_tok_s"])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("parity", "bench"))
    ap.add_argument("preset", choices=tuple(CUT))
    ap.add_argument("--json", default=None, help="write the result here too")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, toy widths: checks the code paths only")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs CUDA (or --smoke)")
    device, dtype = (torch.device("cpu"), "float32") if args.smoke else (torch.device("cuda"), "bfloat16")
    if args.smoke:
        args.input_len, args.output_len, args.concurrency = 16, 6, 4
    if args.what == "parity":
        res = parity(args.preset, device, dtype, args.smoke)
    else:
        res = bench(args.preset, args.input_len, args.output_len, args.concurrency, device, dtype, args.smoke)
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if res.get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
