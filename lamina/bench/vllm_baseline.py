"""`--baseline vllm`: vLLM on the same token-id workload and the same model shape, in a child process.

The parent (this module) builds the rounds a bench times, writes them with vLLM's engine arguments to a job
file, and runs lamina/bench/vllm_runner.py in the same Python and environment; the child prints one result
line, which is summarized here the way lamina's own figures are (same fields, same medians).

Model: a `random:` preset becomes its HF config.json in a temp dir, loaded with load_format="dummy" (random
weights of the same shape); an HF checkpoint directory is loaded as it is. GGUF files are not supported.
Engine settings follow lamina's flags (max_num_seqs, max_num_batched_tokens, max_model_len,
gpu_memory_utilization, enforce_eager, prefix caching, seed, dtype); `--vllm-args JSON` overrides any.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from lamina.bench.vllm_runner import RESULT_MARKER


class VLLMBaselineError(RuntimeError):
    """vLLM ran but gave no result (its one-line message is the error's text)."""


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-args", default="{}",
                   help="--baseline vllm: JSON of vllm.LLM keyword arguments, over the ones lamina's flags give")


def require_vllm(args: argparse.Namespace) -> None:
    """Fails at once, with one line, when the vLLM baseline cannot run: vLLM missing, a model it cannot take,
    or --vllm-args that are not a JSON object. Called before lamina's own run, so no minutes are spent first."""
    from lamina.models.loader import resolve_source

    model = args.model
    try:
        extra = json.loads(getattr(args, "vllm_args", "{}") or "{}")
    except json.JSONDecodeError as e:
        raise SystemExit(f"lamina bench: --vllm-args is not JSON: {e}") from None
    if not isinstance(extra, dict):
        raise SystemExit("lamina bench: --vllm-args must be a JSON object of vllm.LLM keyword arguments")
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(f"lamina bench: --baseline vllm needs vLLM, which {sys.executable} cannot import "
                         "(install vllm, or put it on PYTHONPATH)")
    if resolve_source(model).kind == "gguf":
        raise SystemExit(f"lamina bench: --baseline vllm takes an HF checkpoint directory or a random: preset, "
                         f"not the GGUF model {model!r}")


def engine_args(model: str, dtype: str, args: argparse.Namespace, workdir: str | Path,
                enable_prefix_caching: bool) -> dict[str, Any]:
    """vllm.LLM keyword arguments for the model and settings lamina ran with (dtype: "bfloat16", ...)."""
    from lamina.models.loader import resolve_source

    src = resolve_source(model)
    kw: dict[str, Any] = {}
    arch = ""
    if src.kind == "random":
        from lamina.bench.checkpoint import save_config

        cfg_dir = save_config(src.preset, Path(workdir) / "model", dtype)
        kw.update(model=str(cfg_dir), load_format="dummy")
        arch = json.loads((cfg_dir / "config.json").read_text())["architectures"][0]
    elif src.kind == "hf":
        kw["model"] = str(src.path)
        arch = (json.loads((src.path / "config.json").read_text()).get("architectures") or [""])[0]
    else:
        raise ValueError(f"vLLM baseline: unsupported model kind {src.kind!r}")
    # Token ids in, token ids out: no tokenizer on either side of the comparison.
    kw.update(skip_tokenizer_init=True, dtype=dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.enforce_eager, enable_prefix_caching=enable_prefix_caching, seed=args.seed)
    if args.max_model_len is not None:
        kw["max_model_len"] = args.max_model_len
    if getattr(args, "quantization", None):  # the same online quantization (vLLM's per-tensor FP8)
        kw["quantization"] = args.quantization
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    if arch.startswith("Qwen3Next"):
        # Without flashinfer, vLLM's Hopper default GDN prefill kernel is missing and its engine dies.
        kw["additional_config"] = {"gdn_prefill_backend": "triton"}
    kw.update(json.loads(getattr(args, "vllm_args", "{}") or "{}"))
    return kw


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # lamina must import in the child as it does here; appended, so it shadows nothing on the path.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), root) if p)
    if importlib.util.find_spec("flashinfer") is None:
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # its sampler would be picked, then fail to import
    return env


def _echo(stream) -> None:
    for line in stream:
        sys.stderr.write(line)


def run_vllm(engine: dict[str, Any], rounds: list[dict], workdir: str | Path, exit_timeout: float = 120.0) -> dict:
    """Runs the rounds on one vLLM engine in a child process; returns its result payload. The child's own
    output goes to stderr; VLLMBaselineError carries its one-line error. After the result line the child
    has exit_timeout seconds to shut down, then it is killed."""
    job = Path(workdir) / "job.json"
    job.write_text(json.dumps({"engine": engine, "rounds": rounds}))
    code = "import sys; from lamina.bench.vllm_runner import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, str(job)], stdout=subprocess.PIPE, env=_child_env(),
                            text=True)
    payload = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(RESULT_MARKER + " "):
            payload = json.loads(line[len(RESULT_MARKER) + 1:])
            break
        sys.stderr.write(line)
    # After the result, the rest (shutdown logs) is echoed on the side: a process vLLM started may keep the
    # pipe open a while after the child is gone, and the result must not wait for it.
    rest = threading.Thread(target=_echo, args=(proc.stdout,), daemon=True)
    rest.start()
    try:
        rc = proc.wait(None if payload is None else exit_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    rest.join(0.5)
    if payload is None:
        raise VLLMBaselineError(f"the vLLM child exited with status {rc} and no result line")
    if "error" in payload:
        raise VLLMBaselineError(payload["error"])
    return payload


def _round(prompts: list[list[int]], max_tokens: list[int], stream: bool, temperature: float = 0.0) -> dict:
    return {"prompts": prompts, "max_tokens": max_tokens, "temperature": temperature, "stream": stream}


def _median(values: list[float]) -> float:
    """The median lamina's benches report: the upper middle value of the sorted list."""
    return sorted(values)[len(values) // 2]


def throughput_rounds(prompts: list[list[int]], output_lens: list[int], temperature: float) -> list[dict]:
    """lamina's run_throughput: a warm-up on the first two prompts (4 tokens), then one generate call."""
    return [_round(prompts[:2], [4] * len(prompts[:2]), False), _round(prompts, output_lens, False, temperature)]


def summarize_throughput(payload: dict, output_lens: list[int], prompt_tokens: int) -> dict:
    timed = payload["rounds"][-1]
    n_out = sum(timed["output_tokens"])
    res = {"vllm_version": payload["vllm_version"], "startup_s": payload.get("startup_s"),
           "elapsed_s": timed["elapsed_s"], "output_tokens": n_out, "output_tok_s": n_out / timed["elapsed_s"],
           "total_tok_s": (n_out + prompt_tokens) / timed["elapsed_s"]}
    if n_out != sum(output_lens):
        res["warning"] = f"vLLM generated {n_out} tokens, the workload asks for {sum(output_lens)}"
    return res


def latency_rounds(prompt: list[int], output_len: int, repeats: int) -> list[dict]:
    """lamina's run_latency: repeats + 1 single-request runs (the first a warm-up), each prompt with another
    first token so no prefix cache serves it."""
    return [_round([[prompt[0] + r + 1] + prompt[1:]], [output_len], True) for r in range(repeats + 1)]


def summarize_latency(payload: dict, output_len: int) -> dict:
    ttfts, rates = [], []
    for rnd in payload["rounds"][1:]:
        ttft = rnd["ttft_s"][0]
        ttfts.append(ttft)
        rates.append((output_len - 1) / max(rnd["elapsed_s"] - ttft, 1e-9))
    return {"vllm_version": payload["vllm_version"], "startup_s": payload.get("startup_s"),
            "ttft_s": _median(ttfts), "decode_tok_s": _median(rates)}


def prefix_rounds(warm: list[list[int]], prompts: list[list[int]], output_len: int) -> list[dict]:
    """lamina's prefix bench: a warm-up generate on other prompts (4 tokens), then every request at once."""
    return [_round(warm, [4] * len(warm), False), _round(prompts, [output_len] * len(prompts), True)]


def summarize_prefix(payload: dict, prompts: list[list[int]], output_len: int) -> dict:
    timed = payload["rounds"][-1]
    ttfts = sorted(t for t in timed["ttft_s"] if t is not None)
    total = sum(len(p) for p in prompts)
    return {"vllm_version": payload["vllm_version"], "startup_s": payload.get("startup_s"), "prefix_caching": True,
            "elapsed_s": timed["elapsed_s"], "prompt_tokens": total,
            "prefill_tokens_computed": total - sum(timed["cached_tokens"]),
            "ttft_median_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))],
            "output_tok_s": sum(timed["output_tokens"]) / timed["elapsed_s"]}


def _run_baseline(model: str, dtype: str, args: argparse.Namespace, rounds: list[dict],
                  enable_prefix_caching: bool) -> tuple[dict, dict]:
    """(payload, engine arguments); the payload is {"error": ...} when vLLM failed (the line is printed)."""
    with tempfile.TemporaryDirectory(prefix="lamina-vllm-") as workdir:
        engine = engine_args(model, dtype, args, workdir, enable_prefix_caching)
        try:
            return run_vllm(engine, rounds, workdir), engine
        except VLLMBaselineError as e:
            print(f"lamina bench: the vLLM baseline failed: {e}", file=sys.stderr)
            return {"error": str(e)}, engine


def _before_baseline(result: dict, path: str | None, device) -> None:
    """lamina's figures go to the result file first (they survive a baseline that fails), and its device
    memory is returned before vLLM starts."""
    from lamina.bench.common import free_device

    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    free_device(device)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compare_throughput(result: dict, args: argparse.Namespace, wl, device, dtype) -> None:
    """Adds result["vllm"] (or its error) and ratio_output_tok_s (lamina / vLLM) to a throughput result."""
    _before_baseline(result, args.result_file, device)
    payload, engine = _run_baseline(args.model, _dtype_name(dtype), args,
                                    throughput_rounds(wl.prompts, wl.output_lens, args.temperature),
                                    args.enable_prefix_caching)
    if "error" in payload:
        result["vllm"] = {**payload, "engine_args": engine}
        return
    result["vllm"] = {**summarize_throughput(payload, wl.output_lens, wl.num_prompt_tokens), "engine_args": engine}
    result["ratio_output_tok_s"] = result["lamina"]["output_tok_s"] / result["vllm"]["output_tok_s"]


def compare_latency(result: dict, args: argparse.Namespace, prompt: list[int], device, dtype) -> None:
    """Adds result["vllm"] (or its error) and ratio_decode_tok_s, ratio_ttft (both > 1: lamina faster)."""
    _before_baseline(result, args.result_file, device)
    payload, engine = _run_baseline(args.model, _dtype_name(dtype), args,
                                    latency_rounds(prompt, args.output_len, args.repeats), args.enable_prefix_caching)
    if "error" in payload:
        result["vllm"] = {**payload, "engine_args": engine}
        return
    result["vllm"] = {**summarize_latency(payload, args.output_len), "engine_args": engine}
    result["ratio_decode_tok_s"] = result["lamina"]["decode_tok_s"] / result["vllm"]["decode_tok_s"]
    result["ratio_ttft"] = result["vllm"]["ttft_s"] / result["lamina"]["ttft_s"]


def compare_prefix(result: dict, args: argparse.Namespace, warm: list[list[int]], prompts: list[list[int]],
                   device, dtype) -> None:
    """Adds result["vllm"] (prefix cache on; or its error) and, against lamina's cache-on run,
    ratio_speed_cache_on (vLLM elapsed / lamina elapsed) and ratio_ttft_median_cache_on (both > 1: lamina
    faster)."""
    _before_baseline(result, args.result_file, device)
    payload, engine = _run_baseline(args.model, _dtype_name(dtype), args,
                                    prefix_rounds(warm, prompts, args.output_len), True)
    if "error" in payload:
        result["vllm"] = {**payload, "engine_args": engine}
        return
    result["vllm"] = {**summarize_prefix(payload, prompts, args.output_len), "engine_args": engine}
    on = result["cache_on"]
    result["ratio_speed_cache_on"] = result["vllm"]["elapsed_s"] / on["elapsed_s"]
    result["ratio_ttft_median_cache_on"] = result["vllm"]["ttft_median_s"] / on["ttft_median_s"]


def failed(result: dict) -> bool:
    """Whether the result carries a vLLM baseline that failed (the command then exits 1)."""
    return "error" in (result.get("vllm") or {})
