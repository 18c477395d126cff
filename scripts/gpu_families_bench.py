#!/usr/bin/env python3
"""One GPU call (<= 5 minutes) for issue 17's H200 figures: correctness first, then timings.

Stages, each a subprocess with its own log and JSON under $OUT (or ./families_bench) and a time limit cut to
what is left of --budget-s, so a slow stage cannot take the ones after it down with it:
  parity-*   scripts/families_stage.py parity: each family's preset cut to a few layers with random bf16
             weights saved as a checkpoint; lamina (bf16, graphs) vs HF transformers (fp32) logprobs on the
             same token ids, chunks cutting inside sliding windows / scan chunks (Gemma 3 4B, Nemotron-H 8B,
             DeepSeek-V2-Lite shapes)
  mamba      scripts/mamba_ssd_bench.py --prefill-only: Mamba-2 chunked-scan prefill tokens/s, Triton vs the
             torch reference, at Nemotron-H 8B's mixer shape (checked against the reference first)
  bench-*    scripts/families_stage.py bench: the full preset (random:, bf16): batch-1 decode tok/s and % of
             the HBM roofline on the bytes one decode step reads (weights with MoE's active experts only, plus
             KV/state at the mean context), 64-concurrent throughput; HF transformers in the same process on
             the same config (batch 1 static cache where it works and dynamic; batch 64 padded generate).
             Mixed prefill+decode graphs are not captured here (LAMINA_MIXED_GRAPHS=0: they cost capture time,
             and these workloads' steps are prefill-only or decode-only); decode graphs are.
  mla-graph  scripts/mla_graph_check.py: DeepSeek (MLA) mixed prefill+decode steps through captured CUDA
             graphs == eager (fp32), and graphs vs eager wall time (bf16); last, as it is the newest path
             (run it alone with --only mla-graph if the budget ran out before it)

    python scripts/gpu_families_bench.py [--budget-s 295] [--only parity-gemma3,bench-gemma3]
Prints each stage's tail and a compact summary; writes families_bench.json (all stages' results).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"gemma3": "gemma3-4b", "nemotron": "nemotron-h-8b", "deepseek": "deepseek-v2-lite"}


def stages(out: Path) -> list[tuple[str, list[str], float, dict]]:
    """(name, command, time limit in s, extra environment); a stage writes out/<name>.json."""
    py, stage = sys.executable, "scripts/families_stage.py"
    todo = [(f"parity-{f}", [py, stage, "parity", p, "--json", str(out / f"parity-{f}.json")], 45, {})
            for f, p in FAMILIES.items()]
    todo.append(("mamba", [py, "scripts/mamba_ssd_bench.py", "--prefill-only", "--prefill-tokens", "4096", "16384"],
                 30, {}))
    todo += [(f"bench-{f}", [py, stage, "bench", p, "--json", str(out / f"bench-{f}.json")], 75,
              {"LAMINA_MIXED_GRAPHS": "0"}) for f, p in FAMILIES.items()]
    if (ROOT / "scripts/mla_graph_check.py").is_file():
        todo.append(("mla-graph", [py, "scripts/mla_graph_check.py", "--json", str(out / "mla-graph.json")], 60, {}))
    return todo


def _json_tail(text: str) -> dict | None:
    """The last top-level JSON object a stage printed (mamba_ssd_bench prints one)."""
    start = text.rfind("\n{")
    start = 0 if text.startswith("{") and start < 0 else start + 1
    try:
        return json.loads(text[start:])
    except ValueError:
        return None


def summarize(name: str, res: dict) -> str:
    """One line per stage for the compact summary."""
    if name.startswith("parity-"):
        worst = max((p["max_delta"] for p in res.get("prompts", [])), default=float("nan"))
        agree = ", ".join(f"{p['agree']}/{p['num_greedy']}" for p in res.get("prompts", []))
        return f"{'PASS' if res.get('passed') else 'FAIL'} max|dlogprob| {worst:.3f} greedy {agree}"
    if name == "mamba":
        return "; ".join(f"{p['tokens']} tok: triton {p['triton_tok_s']:.3g} tok/s vs torch ref "
                         f"{p['torch_ref_tok_s']:.3g} ({p['speedup']:.1f}x, rel err {p['rel_err_y']:.1e})"
                         for p in res.get("prefill", []))
    if name == "mla-graph":
        f = res["fp32"]
        return (f"{'PASS' if res.get('passed') else 'FAIL'} sequences equal {f['sequences_equal']}, max|dlogprob| "
                f"{f['max_delta_logprob']:.2e}, mixed keys {f['mixed_keys']}; bf16 graphs "
                f"{res['bf16_wall_s']['speedup']:.2f}x eager")
    if name.startswith("bench-"):
        lam, hf = res["lamina"], res["hf"]
        conc = next(k for k in lam if k.startswith("concurrent"))
        b1 = lam["batch1"]
        hf_b1 = ", ".join(f"{k[7:]} {v['decode_tok_s']:.1f} ({100 * v['roofline_frac']:.0f}%)"
                          for k, v in hf.items() if k.startswith("batch1") and "decode_tok_s" in v)
        return (f"batch1 {b1['decode_tok_s']:.1f} tok/s = {100 * b1['roofline_frac']:.0f}% of roofline "
                f"({res['bytes_per_token']['roofline_tok_s']:.0f} tok/s) | HF {hf_b1} | {conc} "
                f"{lam[conc]['output_tok_s']:.0f} out tok/s vs HF {hf[conc]['output_tok_s']:.0f} "
                f"({res['ratio_concurrent']:.1f}x)")
    return json.dumps(res)[:200]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=295)
    ap.add_argument("--only", default=None, help="comma-separated stage names")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT") or ROOT / "families_bench")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    summary: dict = {}
    results: dict = {}
    try:
        subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw",
                        "--format=csv"], check=False)
    except FileNotFoundError:  # not a GPU machine: the stages will say so
        pass
    for name, cmd, limit, extra in stages(out):
        if args.only and name not in args.only.split(","):
            continue
        left = args.budget_s - (time.perf_counter() - start)
        if left < 15:
            summary[name] = {"status": "skipped (time budget)"}
            continue
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep carried wheels
        env = dict(os.environ, OUT=str(out), PYTHONPATH=path, **extra)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=min(limit, left - 5))
            rc, text = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as exc:
            rc, text = "timeout", exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        (out / f"{name}.log").write_text(text)
        summary[name] = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
        path = out / f"{name}.json"
        res = json.loads(path.read_text()) if path.is_file() else _json_tail(text) if rc == 0 else None
        if res is not None:
            results[name] = res
            if name == "mamba":
                path.write_text(json.dumps(res, indent=1))
            try:
                summary[name]["line"] = summarize(name, res)
            except (KeyError, StopIteration, TypeError, ValueError) as exc:
                summary[name]["line"] = f"(no summary: {type(exc).__name__}: {exc})"
        tail = "\n".join(text.splitlines()[-25:])
        print(f"\n===== {name}: rc={rc} in {summary[name]['wall_s']} s =====\n{tail}", flush=True)
    (out / "families_bench.json").write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    print("\n===== summary =====")
    for name, s in summary.items():
        line = s.get("line", s.get("status", ""))
        print(f"{name:16s} rc={s.get('rc', '-')!s:8s} {s.get('wall_s', '')!s:>6s}s  {line}")
    return 0 if all(v.get("rc") == 0 for v in summary.values() if "rc" in v) else 1


if __name__ == "__main__":
    sys.exit(main())
