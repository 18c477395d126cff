"""GPU check of the CUDA graphs for mixed prefill+decode steps (run on the H200, ~3-4 min of device time).

    python3 scripts/gpu_graph_check.py [--model random:qwen3-0.6b] [--out DIR] [--skip-eager-bench]
    python3 scripts/gpu_graph_check.py --hybrid [--out DIR] [--skip-tiny]      (~5 min)

Each mode runs in a fresh child process (own KV pool, own graphs):
  graphs  every step replays a graph (decode graphs + mixed graphs), the new default
  decode  decode-only graphs, mixed steps eager (LAMINA_MIXED_GRAPHS=0: the previous behaviour)
  eager   --enforce-eager, no graph at all

Checks, per dtype (fp32: near-exact; bf16: within the bf16 noise that decode graphs already show vs eager):
- a staggered mixed workload (requests join every few steps, so prefill chunks of many sizes meet decode
  rows; prompt lengths 1..700; logprobs and prompt logprobs on) gives the same greedy tokens as eager up to
  the first near-tie, with logprobs close; every KV block is free afterwards;
- with graphs on, no step ran eagerly (counted per step kind).
Timings (bf16): start-up and graph capture (time, memory), the offline throughput workload of BENCHMARKS.md
(256 requests, prompts U[100,1024], 512 out, --max-num-batched-tokens 8192) and a server-like one (64
in flight, a new request as soon as one finishes: mixed steps all along). A table is printed at the end and
everything is written to DIR/graph_check.json.

--hybrid (gated delta net + gated attention + MoE):
- random:tiny-qwen3-next (dk = 32; skipped with --skip-tiny): the staggered workload in fp32 (graphs vs eager)
  and bf16 (graphs and decode vs eager), as above; every KV block and state slot free afterwards;
- then scripts/hybrid_graph_check.py (~4 min, its docstring has the details): the Qwen3-Next-80B-A3B shape cut
  to 8 layers in fp32, mixed graphs vs eager on the bench workload's shape (near-tie aware), and the 24-layer
  bench workload in bf16 timed with mixed graphs off and on. `--hybrid --skip-tiny` runs only that.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter

MODES = {"graphs": {"LAMINA_HYBRID_MIXED_GRAPHS": "1"}, "decode": {"LAMINA_MIXED_GRAPHS": "0"}, "eager": {}}
TINY_HYBRID = "random:tiny-qwen3-next"
HYBRID_BENCH = ["--model", "random:qwen3-next-80b-a3b-24l", "--num-prompts", "64", "--input-len", "1024",
                "--output-len", "256", "--max-num-seqs", "64", "--max-num-batched-tokens", "8192"]
TOL = {"float32": 1e-3, "bfloat16": 0.08}  # max |d logprob| graph vs eager (bf16: see the decode baseline)
TIE = {"float32": 1e-3, "bfloat16": 0.08}  # a greedy divergence is accepted where eager's top two are this close


# ---- child ------------------------------------------------------------------------------------------------
def _count_steps(eng, counts: Counter) -> None:
    runner = eng.runner
    orig = runner.execute

    def execute(batch):
        g = runner.graphs
        key = g.pick(batch) if g is not None else None
        mixed = not batch.ctx.attn.is_decode_only
        counts[("mixed" if mixed else "decode") + ("_graph" if key is not None else "_eager")] += 1
        if key is not None and not key.decode:
            counts["mixed_pad_rows"] += key.tokens - batch.input_ids.shape[0]
            counts["mixed_rows"] += batch.input_ids.shape[0]
        return orig(batch)

    runner.execute = execute


def _staggered(eng, n: int, seed: int, every: int, per_join: int, out_len: tuple[int, int]) -> dict:
    from lamina import SamplingParams

    rng = random.Random(seed)
    vocab = eng.model_config.vocab_size
    reqs = []
    for i in range(n):
        plen = rng.choice([1, 2, 15, 16, 17]) if i % 7 == 0 else rng.randint(3, 700)
        prompt = [rng.randrange(1000, vocab) for _ in range(plen)]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(*out_len), ignore_eos=True, logprobs=2,
                                prompt_logprobs=2 if i % 11 == 5 else None)
        reqs.append((f"r{i}", {"prompt_token_ids": prompt}, params))
    outs, step = {}, 0
    while reqs or eng.has_unfinished_requests():
        if step % every == 0:
            for _ in range(per_join):
                if reqs:
                    eng.add_request(*reqs.pop(0))
        for o in eng.step():
            if o.finished:
                c = o.outputs[0]
                outs[o.request_id] = {
                    "tokens": c.token_ids,
                    "logprobs": [{str(t): lp.logprob for t, lp in pos.items()} for pos in c.logprobs or []],
                    "prompt_logprobs": [None if p is None else {str(t): lp.logprob for t, lp in p.items()}
                                        for p in o.prompt_logprobs or []]}
        step += 1
    return outs


def _server_like(eng, n: int, conc: int, in_len: int, out_len: int) -> dict:
    """n requests, conc in flight, a new one as soon as one finishes (mixed steps throughout)."""
    from lamina import SamplingParams
    from lamina.bench.offline import sync

    rng = random.Random(1)
    vocab = eng.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    prompts = [[rng.randrange(1000, vocab) for _ in range(in_len)] for _ in range(n)]
    sync(eng.device)
    start = time.perf_counter()
    added = done = 0
    while done < n:
        while added < n and added - done < conc:
            eng.add_request(f"s{added}", {"prompt_token_ids": prompts[added]}, params)
            added += 1
        done += sum(o.finished for o in eng.step())
    sync(eng.device)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tok_s": n * out_len / elapsed}


def _all_free(eng) -> bool:
    pool = eng.state_pool
    return (eng.allocator.num_free == eng.allocator.num_blocks and not eng.groups
            and (pool is None or pool.num_free == pool.num_slots))


def _hybrid_bench_engine(dtype: str, model: str):
    """The engine settings and parsed arguments of the hybrid `lamina bench throughput` command line (model:
    its preset, or the tiny one in a --small smoke run)."""
    from lamina.args import engine_kwargs
    from lamina.cli import build_parser

    cli = build_parser().parse_args(["bench", "throughput", *HYBRID_BENCH, "--dtype", dtype])
    cli.model = model
    return engine_kwargs(cli), cli


def child(args) -> None:
    import torch

    from lamina import LLM
    from lamina.bench.offline import run_throughput
    from lamina.bench.workload import make_workload

    torch.manual_seed(0)  # random: presets draw their weights from the global generator: same model per mode
    t0 = time.perf_counter()
    kw = dict(model=args.model, dtype=args.dtype, max_num_seqs=256, max_num_batched_tokens=8192,
              enforce_eager=args.child == "eager", progress=False)
    llm = LLM(**kw)
    eng = llm.engine
    res = {"mode": args.child, "dtype": args.dtype, "model": kw["model"], "startup_s": time.perf_counter() - t0}
    g = eng.runner.graphs
    if g is not None:
        res.update(graphs=len(g.graphs), capture_s=g.capture_s, capture_gib=g.capture_bytes / 2**30,
                   mixed_sizes=g.mixed_sizes)
    counts: Counter = Counter()
    _count_steps(eng, counts)
    eng.stream_outputs = True
    res["outputs"] = _staggered(eng, 10 if args.small else 48, seed=3, every=2, per_join=2,
                                out_len=(2, 6) if args.small else (4, 40))
    res["all_free"] = _all_free(eng)
    res["steps_check"] = dict(counts)
    if args.bench:
        counts.clear()
        eng.stream_outputs = False
        n, out = (8, 8) if args.small else (256, 512)
        wl = make_workload(n, (100, 1024), (out, out), eng.model_config.vocab_size, seed=0)
        res["offline"] = run_throughput(llm, wl)
        res["steps_offline"] = dict(counts)
        counts.clear()
        eng.stream_outputs = True
        _server_like(eng, 4 if args.small else 16, 16, 512, 8)  # warm-up of this shape
        counts.clear()
        res["server_like"] = _server_like(eng, *((8, 4, 64, 8) if args.small else (256, 64, 512, 128)))
        res["steps_server_like"] = dict(counts)
        res["all_free_after_bench"] = _all_free(eng)
    res["peak_gib"] = torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0
    with open(args.result, "w") as f:
        json.dump(res, f)


# ---- parent -----------------------------------------------------------------------------------------------
def compare(got: dict, want: dict, tie: float) -> dict:
    """Greedy tokens equal up to the first near-tie (eager's top two within `tie`); max |d logprob| over
    the compared positions."""
    worst, agree, tie_breaks, bad = 0.0, 0, 0, []
    for rid, w in want.items():
        g = got[rid]
        for lg, lw in zip(g["prompt_logprobs"], w["prompt_logprobs"]):
            if lg is not None:
                worst = max(worst, max(abs(lg[t] - lw[t]) for t in lg if t in lw))
        n = 0
        for i, (tg, tw) in enumerate(zip(g["tokens"], w["tokens"])):
            lg, lw = g["logprobs"][i], w["logprobs"][i]
            if tg != tw:
                gap = lw[str(tw)] - lw.get(str(tg), float("-inf"))
                if gap > tie:
                    bad.append((rid, i, gap))
                tie_breaks += 1
                break
            worst = max(worst, max(abs(lg[t] - lw[t]) for t in lg if t in lw))
            n += 1
        agree += n == len(w["tokens"])
    return {"max_dlogprob": worst, "full_agreement": agree, "requests": len(want), "near_tie_breaks": tie_breaks,
            "mismatches": bad}


def _plan(args) -> list[dict]:
    """The child runs: name, model, dtype, mode, and what else it does."""
    def run(prefix, model, dtype, mode, **flags):
        return {"name": f"{prefix}{dtype} {mode}", "model": model, "dtype": dtype, "mode": mode, **flags}

    def staggered(prefix, model, bench):
        return [run(prefix, model, "float32", m) for m in ("graphs", "eager")] + \
            [run(prefix, model, "bfloat16", m, bench=bench and not (m == "eager" and args.skip_eager_bench))
             for m in ("graphs", "decode", "eager")]

    if not args.hybrid:
        return staggered("", args.model, True)
    return [] if args.skip_tiny else staggered("tiny ", TINY_HYBRID, False)


def _comparisons(plan: list[dict]) -> list[tuple[str, str, str]]:
    """(run, its reference, dtype): every graph mode against eager where an eager run exists, else the hybrid
    80b graphs against decode (whose mixed steps are eager)."""
    names = {r["name"] for r in plan}
    out = []
    for r in plan:
        if r["mode"] == "eager":
            continue
        prefix = r["name"][: -len(f"{r['dtype']} {r['mode']}")]
        ref = f"{prefix}{r['dtype']} eager"
        if ref not in names and r["mode"] == "graphs":
            ref = f"{prefix}{r['dtype']} decode"
        if ref in names:
            out.append((r["name"], ref, r["dtype"]))
    return sorted(out, key=lambda c: not c[0].endswith("decode"))  # decode first: the bf16 yardstick


def _table(runs: dict) -> None:
    print("\nrun                  startup_s  graphs  capture_s  capture_GiB  offline_tok/s  server_like_tok/s  "
          "mixed steps graph/eager  pad%")
    for name, r in runs.items():
        if r["dtype"] != "bfloat16":
            continue
        s = r.get("steps_server_like") or {}
        pad = 100 * s.get("mixed_pad_rows", 0) / max(s.get("mixed_pad_rows", 0) + s.get("mixed_rows", 0), 1)
        print(f"{name:<20} {r['startup_s']:>9.1f}  {r.get('graphs', 0):>6}  {r.get('capture_s', 0):>9.2f}  "
              f"{r.get('capture_gib', 0):>11.2f}  {r.get('offline', {}).get('output_tok_s', 0):>13,.0f}  "
              f"{r.get('server_like', {}).get('output_tok_s', 0):>17,.0f}  "
              f"{s.get('mixed_graph', 0):>10}/{s.get('mixed_eager', 0):<12}  {pad:4.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-eager-bench", action="store_true", help="no throughput timing of the eager mode")
    ap.add_argument("--hybrid", action="store_true", help="the hybrid checks and the hybrid workload A/B")
    ap.add_argument("--skip-tiny", action="store_true", help="--hybrid: only the 80b runs")
    ap.add_argument("--small", action="store_true", help="tiny workloads (a CPU smoke run of the script)")
    ap.add_argument("--child", choices=list(MODES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--result")
    args = ap.parse_args()
    if args.child:
        return child(args)
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    plan = _plan(args)
    for r in plan:
        path = os.path.join(args.out, "graph_check_" + r["name"].replace(" ", "_") + ".json")
        cmd = [sys.executable, __file__, "--child", r["mode"], "--dtype", r["dtype"], "--model", r["model"],
               "--result", path]
        cmd += ["--bench"] if r.get("bench") else []
        cmd += ["--small"] if args.small else []
        env = {**os.environ, **MODES[r["mode"]]}
        t = time.perf_counter()
        proc = subprocess.run(cmd, env=env, check=False)
        print(f"[{r['name']}] exit {proc.returncode} in {time.perf_counter() - t:.1f} s", flush=True)
        if proc.returncode == 0:
            with open(path) as f:
                runs[r["name"]] = json.load(f)
    failures = [f"{r['name']}: the run failed" for r in plan if r["name"] not in runs]
    summary = {}
    for name, ref_name, dtype in _comparisons(plan):
        r, ref = runs.get(name), runs.get(ref_name)
        if r is None or ref is None:
            continue
        # Mixed graphs may differ from eager by at most twice what decode graphs already do (bf16); the 80b
        # graphs-vs-decode comparison (MoE routing over 512 experts flips on bf16 noise) gets twice the bound.
        base = summary.get(name.replace("graphs", "decode") + " vs " + ref_name, {}).get("max_dlogprob", 0.0)
        tol = max(TOL[dtype], 2 * base) if r["mode"] == "graphs" else TOL[dtype]
        if ref_name.endswith("decode"):
            tol *= 2
        c = compare(r["outputs"], ref["outputs"], max(TIE[dtype], tol))
        summary[f"{name} vs {ref_name}"] = c
        if c["mismatches"]:
            failures.append(f"{name}: tokens differ from {ref_name} beyond a near-tie: {c['mismatches'][:5]}")
        if c["max_dlogprob"] > tol:
            failures.append(f"{name}: max |d logprob| vs {ref_name} {c['max_dlogprob']:.2e} > {tol:.2e}")
    for name, r in runs.items():
        if r["mode"] == "graphs":
            for part in ("steps_check",):
                eager = r.get(part, {}).get("mixed_eager", 0) + r.get(part, {}).get("decode_eager", 0)
                if eager:
                    failures.append(f"{name}: eager steps ran ({part}): {r[part]}")
        if not r["all_free"] or not r.get("all_free_after_bench", True):
            failures.append(f"{name}: KV blocks or state slots leaked")
    if args.hybrid:  # the 80B shape: its own script and children (fp32 correctness, bf16 timing)
        from hybrid_graph_check import run_all

        failures += [f"80b {f}" for f in run_all(os.path.join(args.out, "hybrid_80b"), args.small)]
    with open(os.path.join(args.out, "graph_check.json"), "w") as f:
        json.dump({"runs": {n: {k: v for k, v in r.items() if k != "outputs"} for n, r in runs.items()},
                   "compare": summary, "failures": failures}, f, indent=1)
    _table(runs)
    for name, c in summary.items():
        print(f"{name:<44} max|dlogprob| {c['max_dlogprob']:.2e}  full agreement {c['full_agreement']}/"
              f"{c['requests']}  near-tie breaks {c['near_tie_breaks']}  mismatches {len(c['mismatches'])}")
    print("FAIL:\n  " + "\n  ".join(failures) if failures else "ALL CHECKS PASSED")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
