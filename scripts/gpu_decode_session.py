#!/usr/bin/env python3
"""One GPU call (<= 6 minutes) for issue 13's decode kernels: correctness first, then timings, then profiles.

Stages, each a subprocess with its own log under $OUT (or ./decode_session) and a time limit cut to what is
left of --budget-s, so a slow stage cannot take the ones after it down with it:
  1. tests   the new kernel tests on the GPU (MoE decode path, gated-norm out_proj GEMV, GDN conv + recurrent
             decode step, decode GEMV incl.
             the PDL chain and CUDA-graph replays); with pytest-xdist, 8 workers
  2. fusion  scripts/gpu_fusion_bench.py (MoE route/down+sum/block, gated norm + out_proj, GEMV chain + PDL);
             it checks each kernel on the real shapes itself and skips the timings of one that fails
  3. gemv    scripts/gpu_kernel_bench.py --gemv-only: every candidate config per Qwen3-8B shape and lm_head vs
             cuBLAS at M = 1, 4, 16
  4. prof8b  scripts/profile_decode.py random:qwen3-8b (4 layers), batch 1, GEMV off and on
  5. profnx  scripts/profile_decode.py random:qwen3-next-80b-a3b-24l (4 layers), batch 1, fusions off and on
  6. profds  scripts/profile_decode.py random:deepseek-v2-lite (4 layers: 1 dense + 3 MoE), batch 1, fusions off
             and on (DeepSeek's routing through the fused MoE decode path; GPU_KERNELS.md has the op estimate)

    python scripts/gpu_decode_session.py [--budget-s 340] [--only tests,fusion]
    python scripts/gpu_decode_session.py --only tests,profds --budget-s 200   (the DeepSeek part alone)
Prints each stage's tail and a summary; writes decode_session.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/kernels/test_moe_decode.py", "tests/kernels/test_moe_decode_deepseek.py",
         "tests/kernels/test_norm_gated_gemv.py",
         "tests/kernels/test_gdn_conv_decode.py", "tests/kernels/test_gemv.py"]


def stages(out: Path) -> list[tuple[str, list[str], float]]:
    py = sys.executable
    xdist = ["-n", "8"] if importlib.util.find_spec("xdist") else ["-k", "not every_config"]
    return [
        ("tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist, *TESTS], 90),
        ("fusion", [py, "scripts/gpu_fusion_bench.py"], 80),
        ("gemv", [py, "scripts/gpu_kernel_bench.py", "--gemv-only", "--ms", "1,4,16", "--budget-s", "55"], 75),
        ("prof8b", [py, "scripts/profile_decode.py", "--model", "random:qwen3-8b", "--layers", "4", "--steps", "32",
                    "--gemv", "both", "--json", str(out / "profile_qwen3_8b.json")], 70),
        ("profnx", [py, "scripts/profile_decode.py", "--model", "random:qwen3-next-80b-a3b-24l", "--layers", "4",
                    "--steps", "32", "--fusions", "both", "--json", str(out / "profile_qwen3_next.json")], 80),
        ("profds", [py, "scripts/profile_decode.py", "--model", "random:deepseek-v2-lite", "--layers", "4",
                    "--steps", "32", "--fusions", "both", "--json", str(out / "profile_deepseek_v2_lite.json")], 90),
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=340)
    ap.add_argument("--only", default=None, help="comma-separated stage names")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "decode_session")
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep the carried wheels
    env = dict(os.environ, OUT=str(out), PYTHONPATH=path)
    start = time.perf_counter()
    summary: dict = {}
    subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw",
                    "--format=csv"], check=False)
    for name, cmd, limit in stages(out):
        if args.only and name not in args.only.split(","):
            continue
        left = args.budget_s - (time.perf_counter() - start)
        if left < 20:
            summary[name] = {"status": "skipped (time budget)"}
            continue
        t0 = time.perf_counter()
        log = out / f"{name}.log"
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=min(limit, left - 5))
            rc, text = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as exc:
            rc, text = "timeout", (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log.write_text(text)
        summary[name] = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
        tail = "\n".join(text.splitlines()[-40:])
        print(f"\n===== {name}: rc={rc} in {summary[name]['wall_s']} s =====\n{tail}", flush=True)
    (out / "decode_session.json").write_text(json.dumps(summary, indent=1))
    print("\nsummary:", json.dumps(summary))
    return 0 if all(v.get("rc") == 0 for v in summary.values() if "rc" in v) else 1


if __name__ == "__main__":
    sys.exit(main())
