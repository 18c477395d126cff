#!/usr/bin/env python3
"""Issue 15's GPU targets in one call (<= 5 minutes on an H200): runs the quantized-kernel benches in their
quick modes, each in its own process under its own time limit, and prints one JSON summary of the figures
the targets name (and writes it to $OUT/quant_targets.json, next to each bench's own JSON):

- batch-1 decode, Qwen3-8B shape (all 36 layers' linears in one CUDA graph, weights from HBM):
  bf16 vs FP8 (block 128 and row scales) vs W4A16 (int4 group 128) vs GGUF Q4_K (int4 group 32);
  targets FP8 >= 1.75x, W4A16 >= 2.8x, Q4_K >= 2.5x (scripts/gpu_wq_bench.py --quick);
- the FP8 tensor-core peak (a large torch._scaled_mm), 8k-token FP8 prefill MFU against it, and decode
  attention over an FP8 vs bf16 KV cache (scripts/fp8_gpu_bench.py --quick);
- the grouped MoE GEMMs over FP8 / W4A16 experts vs bf16 (scripts/quant_moe_bench.py);
- with --throughput, if the budget has room: offline throughput, 256 requests U[100,1024] -> 512 on the
  random Qwen3-8B preset, bf16 vs --quantization fp8 (target FP8 >= 1.25x), each a fresh process.

    python scripts/quant_targets.py [--throughput] [--budget 290]
    python scripts/quant_targets.py --interpret      # CPU: the same plumbing over the benches' tiny checks

Each bench rewrites its JSON after every stage, so one cut off at its limit still gives what it finished.

Exits 1 if a bench's checks failed or a bench did not finish.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = argparse.ArgumentParser()
ARGS.add_argument("--budget", type=float, default=290.0, help="seconds for everything")
ARGS.add_argument("--throughput", action="store_true", help="also the 256-request offline A/B if time allows")
ARGS.add_argument("--interpret", action="store_true",
                  help="CPU dry run: the benches' tiny --interpret checks instead of --quick (tests this plumbing)")
OPTS = ARGS.parse_args()
MODE = "--interpret" if OPTS.interpret else "--quick"
START = time.monotonic()
TARGETS = {"fp8_decode": 1.75, "w4a16_decode": 2.8, "q4k_decode": 2.5, "fp8_offline": 1.25}


def left() -> float:
    return OPTS.budget - (time.monotonic() - START)


def run(label: str, cmd: list[str], out: Path, limit: float) -> dict:
    """Runs one bench with OUT=out; returns {"rc", "seconds", "tail"} (rc None: killed at its limit)."""
    t0 = time.monotonic()
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1.0, limit))
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:  # its partial output may come back as bytes even with text=True
        partial = e.stdout or ""
        rc, text = None, partial.decode(errors="replace") if isinstance(partial, bytes) else partial
    secs = time.monotonic() - t0
    print(f"[{label}] rc={rc} in {secs:.0f} s", file=sys.stderr)
    return {"rc": rc, "seconds": round(secs, 1), "tail": text[-1500:]}


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def decode_summary(rows) -> dict:
    """The M = 1 decode-step row of gpu_wq_bench's JSON -> the three speedups against their targets."""
    row = next((r for r in rows or [] if r.get("timing") == "decode step linears" and r.get("m") == 1), None)
    if row is None:
        return {"missing": True}
    pick = {"fp8_block128": "fp8 block128", "fp8_rows": "fp8 rows", "w4a16_int4_g128": "int4-g128 (W4A16)",
            "gguf_q4k_int4_g32": "int4-g32 (GGUF Q4_K/Q4_0/Q4_1)"}
    out = {"bf16_us": row["bf16_us"], "layers": row["layers"]}
    for key, label in pick.items():
        if label in row:
            out[f"{key}_us"] = row[label]["heuristic_us"]
            out[f"{key}_speedup"] = row[label]["speedup_heuristic"]
    out["targets"] = {"fp8_block128_speedup": TARGETS["fp8_decode"], "w4a16_int4_g128_speedup": TARGETS["w4a16_decode"],
                      "gguf_q4k_int4_g32_speedup": TARGETS["q4k_decode"]}
    out["met"] = {k: out.get(k, 0.0) >= v for k, v in out["targets"].items()}
    return out


def fp8_summary(res) -> dict:
    if not res:
        return {"missing": True}
    prefill = res.get("prefill", [])
    out = {"peaks_tflops": res.get("peaks"), "failed_checks": res.get("failed")}
    if prefill:
        flops = sum(2 * r["m"] * r["n"] * r["k"] for r in prefill)
        keys = ("bf16", "block_gemm", "block_with_quant", "rows_scaled_mm_with_quant", "block_fused_quant",
                "rows_fused_quant", "block_torch_scaled_mm")  # the last three: fused quantization (fp8_linear now)
        layer = {k: flops / sum(r[f"{k}_us"] for r in prefill) / 1e6
                 for k in keys if all(f"{k}_us" in r for r in prefill)}
        out["prefill_8k_layer_tflops"] = layer
        peak = (res.get("peaks") or {}).get("fp8_tflops")
        if peak:
            out["prefill_8k_mfu_vs_fp8_peak"] = {k: v / peak for k, v in layer.items() if k != "bf16"}
        out["prefill_8k_per_shape"] = prefill
    out["kv_decode_attention"] = res.get("kv")
    out["decode_step_estimate"] = res.get("decode_step_estimate")
    out["batch_step_estimate"] = res.get("batch_step_estimate")
    out["blockwise_scaled_mm"] = res.get("blockwise_scaled_mm")
    return out


def throughput(tmp: Path) -> dict:
    base = [sys.executable, "-m", "lamina.cli", "bench", "throughput", "--model", "random:qwen3-8b",
            "--num-prompts", "256", "--input-len", "100:1024", "--output-len", "512", "--max-num-seqs", "256",
            "--max-num-batched-tokens", "8192"]
    out: dict = {}
    for side, extra in (("bf16", []), ("fp8", ["--quantization", "fp8"])):
        if left() < 100:
            out[side] = "skipped: not enough of the budget left"
            continue
        path = tmp / f"throughput_{side}.json"
        out[f"{side}_run"] = run(f"throughput {side}", base + extra + ["--result-file", str(path)], tmp, left() - 5)
        res = load(path)
        out[side] = res["lamina"]["output_tok_s"] if res else None
    if isinstance(out.get("bf16"), float) and isinstance(out.get("fp8"), float):
        out["fp8_speedup"] = out["fp8"] / out["bf16"]
        out["target"], out["met"] = TARGETS["fp8_offline"], out["fp8_speedup"] >= TARGETS["fp8_offline"]
    return out


def main() -> int:
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="quant_targets_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    runs = {"gpu_wq_bench": run("gpu_wq_bench", [py, "scripts/gpu_wq_bench.py", MODE], out_dir, min(120, left())),
            "fp8_gpu_bench": run("fp8_gpu_bench", [py, "scripts/fp8_gpu_bench.py", MODE], out_dir, min(100, left())),
            "quant_moe_bench": run("quant_moe_bench", [py, "scripts/quant_moe_bench.py"]
                                   + (["--interpret"] if OPTS.interpret else []), out_dir, min(70, left()))}
    moe = load(out_dir / "quant_moe_bench.json") or {}
    summary = {"decode_batch1_qwen3_8b_linears": decode_summary(load(out_dir / "gpu_wq_bench.json")),
               "fp8": fp8_summary(load(out_dir / "fp8_gpu_bench.json")),
               "moe_grouped": {"rows": moe.get("rows"), "failed_checks": moe.get("failed")},
               "offline_throughput_256": throughput(out_dir) if OPTS.throughput else "not run (pass --throughput)",
               "runs": {k: {"rc": v["rc"], "seconds": v["seconds"]} for k, v in runs.items()},
               "seconds": round(time.monotonic() - START, 1)}
    bad = [k for k, v in runs.items() if v["rc"] != 0]
    for k in bad:
        summary["runs"][k]["tail"] = runs[k]["tail"]
    (out_dir / "quant_targets.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
