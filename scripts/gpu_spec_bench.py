#!/usr/bin/env python3
"""One GPU call (<= 10 minutes) for issue 14's H200 targets: speculative decoding, K = 3, on
random:qwen3-8b (dense, all 36 layers) and random:qwen3-next-80b-a3b-24l (hybrid, the 24-layer shape;
--hybrid-layers cuts it further if the call runs short: say which in the figures).

Stages, each a subprocess of this script with its own time limit cut to what is left of --budget-s (a slow one
cannot take the ones after it down), JSON per stage under $OUT (or ./spec_bench):
  check_dense, check_hybrid
              correctness first, CUDA graphs on, fp32, both models cut to 4 layers: greedy outputs with ngram
              and with replay (acceptance 0.6) equal the plain run's; replay with graphs equals replay with
              --enforce-eager (the verify steps' graphs against eager: hybrid verify graphs, dense mixed graphs);
              counts the graph kinds each run replayed (hybrid verify steps must replay verify graphs). A
              difference at a near-tie of the plain run (top-2 logprob gap < 1e-3) is reported as such.
  forced_dense, forced_hybrid   (spec_forced_stage.py)
              bf16, CUDA graphs on, ONE engine per model (plain runs with its speculative decoder taken out, so
              plain and speculative share weights, graphs and pool): plain decode, then the bench-only replay
              proposer with forced acceptance p in {0, 0.6, 0.8} (the accepted count is the proposer's decision:
              a real verify step's device work at acceptance p, whatever the numerics; gate off), and p = 0 with
              the default gate (per-sequence and batch-wide pause: the acceptance-0 loss), each at batch 1 and
              64 concurrent (128 prompt, 128 output tokens). Per run: tokens/s, the ratio to plain, measured
              acceptance and mean accepted length against p + p^2 + p^3, engine steps, mean step wall time, and
              the forward's device time (CUDA events around ModelRunner.execute: input copies, graph replay,
              lm_head) of a verify step over a plain decode step at the same batch (targets at batch 1:
              <= 1.15x dense, <= 1.25x hybrid; >= 2.3x tokens/s at 0.8; <= 5% loss at 64 and acceptance 0).

    python scripts/gpu_spec_bench.py [--budget-s 560] [--only check_dense,forced_dense] [--hybrid-layers 24]
    python scripts/gpu_spec_bench.py --cpu-smoke   # the same stages on the CPU with toy presets (logic check)
Prints a compact summary and writes spec_bench.json (every stage's figures) and spec_bench.md (the tables)
under $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# siblings in scripts/ (python puts the script's folder first on sys.path)
from spec_bench_models import DENSE, HYBRID, TARGET_VERIFY, K, cut, device_args, free_memory
from spec_forced_stage import ForwardTimer, forced_markdown, forced_summary_lines, stage_forced

ROOT = Path(__file__).resolve().parents[1]

# (name, time limit s), in priority order: --budget-s skips what no longer fits
STAGES = [("check_dense", 45), ("check_hybrid", 110), ("forced_dense", 140), ("forced_hybrid", 230),
          ("b1_dense", 55), ("b1_hybrid", 60), ("c64_dense", 40), ("c64_hybrid", 50)]
# the default run: the forced stages replace the older b1/c64 ones (replay without forcing; --only runs them)
DEFAULT_STAGES = ("check_dense", "check_hybrid", "forced_dense", "forced_hybrid")


# ---- check ---------------------------------------------------------------------------------------------------
def _prompts(n: int) -> list[dict]:
    import random

    rng = random.Random(3)
    out = []
    for i in range(n):
        phrase = [rng.randrange(1000, 30000) for _ in range(rng.randrange(4, 9))]
        ids = phrase * 3 + phrase[:2] if i % 2 else [rng.randrange(1000, 30000) for _ in range(rng.randrange(8, 60))]
        out.append({"prompt_token_ids": ids})
    return out


def _generate(kw: dict, spec: dict | None, prompts: list[dict], max_tokens: int, reference=None, logprobs=None):
    import torch

    from lamina import LLM, SamplingParams
    from lamina.spec.config import parse_speculative_config

    torch.manual_seed(0)  # random presets: the same weights in every run
    llm = LLM(**kw, speculative_config=parse_speculative_config(spec, bench=True) if spec else None)
    kinds = {"decode": 0, "mixed": 0, "verify": 0, "eager": 0}
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        pick = graphs.pick

        def counted(batch):
            key = pick(batch)
            kinds["eager" if key is None else "verify" if key.verify else "decode" if key.decode else "mixed"] += 1
            return key
        graphs.pick = counted
    if reference is not None:
        llm.engine.spec.proposer.reference.update(reference)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    res = llm.generate(prompts, params, use_tqdm=False)
    st = llm.engine.stats()
    out = ([o.outputs[0].token_ids for o in res], [o.outputs[0].logprobs for o in res],
           {"graph_picks": kinds, "drafts": st.num_spec_draft_tokens, "accepted": st.num_spec_accepted_tokens})
    del llm, res
    free_memory()
    return out


def _compare(ref, ref_lp, got) -> dict:
    """equal, near-tie (first difference where the plain run's top-2 logprobs are within 1e-3), or different."""
    worst = "equal"
    for i, (a, b) in enumerate(zip(ref, got)):
        if a == b:
            continue
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        top = sorted((e.logprob for e in ref_lp[i][j].values()), reverse=True) if ref_lp and j < len(ref_lp[i]) else []
        tie = len(top) >= 2 and top[0] - top[1] < 1e-3
        worst = "DIFFERENT" if not tie else ("near-tie" if worst == "equal" else worst)
        if not tie:
            return {"verdict": worst, "sample": i, "position": j, "gap": top[0] - top[1] if len(top) >= 2 else None}
    return {"verdict": worst}


def stage_check(args, kind: str) -> dict:
    result = {}
    for name in (DENSE if kind == "dense" else HYBRID,):
        model = cut(name, 4)
        kw = dict(model=model, dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, progress=False,
                  warmup=False, **({"device": "cpu", "kv_cache_memory_gb": 0.05} if device_args() else
                                   {"kv_cache_memory_gb": 4}))
        prompts = _prompts(8)
        ref, ref_lp, plain_info = _generate(kw, None, prompts, 48, logprobs=2)
        refmap = {tuple(p["prompt_token_ids"]): o for p, o in zip(prompts, ref)}
        replay = {"method": "replay", "num_speculative_tokens": K, "acceptance_prob": 0.6, "min_acceptance_rate": 0}
        ngram = {"method": "ngram", "num_speculative_tokens": K, "min_acceptance_rate": 0}
        runs = {"plain": plain_info}
        for label, spec, extra in (("ngram", ngram, {}), ("replay", replay, {}),
                                   ("replay_eager", replay, {"enforce_eager": True})):
            ref_of = refmap if "replay" in label else None
            got, _, info = _generate({**kw, **extra}, spec, prompts, 48, reference=ref_of)
            runs[label] = {**info, **_compare(ref, ref_lp, got)}
            if label == "replay":
                replay_graph_out = got
            if label == "replay_eager":
                runs[label]["graphs_vs_eager"] = "equal" if got == replay_graph_out else "DIFFERENT"
        ok = all(r.get("verdict", "equal") != "DIFFERENT" for r in runs.values())
        if kind == "hybrid" and not device_args():  # hybrid verify steps must have replayed verify graphs
            ok = ok and runs["replay"]["graph_picks"]["verify"] > 0
        result[kind] = {"model": model, "runs": runs, "ok": ok}
        print(kind, json.dumps(result[kind]), flush=True)
    return result


def _bench(args, command: str, model: str, spec: dict, extra: list[str], out: Path) -> dict:
    from lamina.cli import main

    path = out / f"bench_{command}_{model.split(':')[1]}.json"
    smoke = bool(device_args())
    argv = ["bench", command, "--model", model, "--dtype", "float32" if smoke else "bfloat16",
            "--kv-cache-memory-gb", "0.05" if smoke else "8",
            "--speculative-config", json.dumps(spec), "--result-file", str(path), *device_args(), *extra]
    if main(argv) != 0:
        raise RuntimeError(f"lamina {' '.join(argv)} failed")
    return json.loads(path.read_text())


def stage_b1(args, kind: str, out: Path) -> dict:
    model = cut(DENSE, None) if kind == "dense" else cut(HYBRID, args.hybrid_layers)
    timer = ForwardTimer()
    spec = {"method": "replay", "num_speculative_tokens": K, "acceptance_prob": 0.8}
    r = _bench(args, "latency", model, spec, ["--input-len", "128", "--output-len", "128", "--repeats", "2",
                                              "--max-num-seqs", "1", "--max-num-batched-tokens", "256"], out)
    plain, verify = timer.median_ms(0, 1, 1), timer.median_ms(1, K + 1, 1)
    ratio = verify / plain if plain and verify else None
    return {"model": model, "speedup_tok_s": r["speedup"], "target_speedup": 2.3,
            "plain_tok_s": r["plain"]["output_tok_s"], "spec_tok_s": r["spec"]["output_tok_s"],
            "acceptance_rate": r["acceptance_rate"], "mean_accepted_length": r["mean_accepted_length"],
            "expected_mean_accepted_length": r.get("expected_mean_accepted_length"),
            "accepted_per_position": r["accepted_per_position"], "outputs_differing": r["outputs_differing"],
            "decode_forward_ms": plain, "verify_forward_ms": verify, "verify_over_decode": ratio,
            "target_verify_over_decode": TARGET_VERIFY[kind], "cuda_graphs": r.get("cuda_graphs")}


def stage_c64(args, kind: str, out: Path) -> dict:
    model = cut(DENSE, None) if kind == "dense" else cut(HYBRID, args.hybrid_layers)
    spec = {"method": "replay", "num_speculative_tokens": K, "acceptance_prob": 0.0}  # default gate (0.1)
    r = _bench(args, "throughput", model, spec, ["--num-prompts", "64", "--input-len", "128", "--output-len", "128",
                                                 "--max-num-seqs", "64", "--max-num-batched-tokens", "2048"], out)
    return {"model": model, "throughput_loss": 1 - r["speedup"], "target_loss": 0.05,
            "plain_tok_s": r["plain"]["output_tok_s"], "spec_tok_s": r["spec"]["output_tok_s"],
            "num_pauses": r["num_pauses"], "num_drafts": r["num_drafts"], "acceptance_rate": r["acceptance_rate"],
            "greedy_outputs_identical": r["greedy_outputs_identical"]}


def run_stage(args, name: str, out: Path) -> dict:
    kind = name.split("_")[1]
    if name.startswith("check"):
        return stage_check(args, kind)
    if name.startswith("forced"):
        return stage_forced(args, kind)
    return stage_b1(args, kind, out) if name.startswith("b1") else stage_c64(args, kind, out)


# ---- orchestration -------------------------------------------------------------------------------------------
def summary_lines(res: dict) -> list[str]:
    lines = []
    for kind in ("dense", "hybrid"):
        c = res.get(f"check_{kind}", {}).get(kind)
        if c:
            # drafts 0 for ngram: the random model's output never repeated, so that run checked nothing
            v = {k: r.get("verdict", "-") + (f"/graphs-vs-eager {r['graphs_vs_eager']}" if "graphs_vs_eager" in r
                                             else "") + f" ({r['accepted']}/{r['drafts']} drafts)"
                 for k, r in c["runs"].items() if k != "plain"}
            lines.append(f"check {kind:6s} ok={c['ok']} {v} picks(replay)={c['runs']['replay']['graph_picks']}")
    lines += forced_summary_lines(res)
    for kind in ("dense", "hybrid"):
        b = res.get(f"b1_{kind}")
        if b and "error" not in b:
            vr = b["verify_over_decode"]
            lines.append(f"b1 {kind:6s} {b['model']}: speed-up {b['speedup_tok_s']:.2f}x (>= 2.3) at acceptance "
                         f"{b['acceptance_rate']:.2f}, mean len {b['mean_accepted_length']:.2f}; verify/decode "
                         f"forward {vr if vr is None else round(vr, 3)} (<= {b['target_verify_over_decode']}); "
                         f"{b['decode_forward_ms']} / {b['verify_forward_ms']} ms; outputs off ref "
                         f"{b['outputs_differing']}")
        c = res.get(f"c64_{kind}")
        if c and "error" not in c:
            lines.append(f"c64 {kind:6s} {c['model']}: loss {100 * c['throughput_loss']:.1f}% (<= 5%), pauses "
                         f"{c['num_pauses']}, drafts {c['num_drafts']}, {c['plain_tok_s']:.0f} -> "
                         f"{c['spec_tok_s']:.0f} tok/s")
    return lines


def markdown(res: dict) -> str:
    """The forced-acceptance tables (one per model) and the check verdicts, for BENCHMARKS.md."""
    lines = forced_markdown(res)
    for line in summary_lines(res):
        if line.startswith("check"):
            lines.append(f"- {line}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--only", default=None, help="comma-separated stage names (default: " + ",".join(DEFAULT_STAGES)
                    + "; the older b1_*/c64_* stages only by name)")
    ap.add_argument("--hybrid-layers", type=int, default=24, help="layers of the hybrid shape in the timed stages")
    ap.add_argument("--cpu-smoke", "--smoke", dest="smoke", action="store_true",
                    help="toy presets on the CPU: checks this script's logic, no figures")
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # run one stage in this process
    args = ap.parse_args()
    if args.smoke:
        os.environ["SPEC_BENCH_SMOKE"] = "1"  # the stages' subprocesses inherit it
    out = Path(os.environ.get("OUT") or ROOT / "spec_bench")
    out.mkdir(parents=True, exist_ok=True)
    if args.stage:
        try:
            res = run_stage(args, args.stage, out)
        except Exception as e:  # noqa: BLE001 - the summary says what failed
            import traceback

            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}"}
        (out / f"{args.stage}.json").write_text(json.dumps(res, indent=1, default=str))
        return 0 if "error" not in res else 1
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep carried wheels
    env = dict(os.environ, OUT=str(out), PYTHONPATH=path)
    start = time.perf_counter()
    results: dict = {"hybrid_layers": args.hybrid_layers}
    for name, limit in STAGES:
        if name not in (args.only.split(",") if args.only else DEFAULT_STAGES):
            continue
        left = args.budget_s - (time.perf_counter() - start)
        if left < 25:
            results[name] = {"error": "skipped (time budget)"}
            continue
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--stage", name, "--hybrid-layers", str(args.hybrid_layers)]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=min(limit, left - 5))
            rc, text = proc.returncode, proc.stdout
        except subprocess.TimeoutExpired as exc:
            rc, text = "timeout", exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        (out / f"{name}.log").write_text(text)
        path = out / f"{name}.json"
        results[name] = json.loads(path.read_text()) if path.is_file() else {"error": f"rc={rc}, no result"}
        results[name + "_wall_s"] = round(time.perf_counter() - t0, 1)
        tail = "\n".join(text.splitlines()[-12:])
        print(f"\n===== {name}: rc={rc} in {results[name + '_wall_s']} s =====\n{tail}", flush=True)
    (out / "spec_bench.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "spec_bench.md").write_text(markdown(results))
    print("\n===== summary =====")
    for line in summary_lines(results):
        print(line)
    for name, _ in STAGES:
        if isinstance(results.get(name), dict) and "error" in results[name]:
            print(f"{name}: {results[name]['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
