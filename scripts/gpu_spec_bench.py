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
  forced_dense, forced_hybrid
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
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DENSE, HYBRID = "qwen3-8b", "qwen3-next-80b-a3b-24l"
K = 3
# (name, time limit s), in priority order: --budget-s skips what no longer fits
STAGES = [("check_dense", 45), ("check_hybrid", 110), ("forced_dense", 140), ("forced_hybrid", 230),
          ("b1_dense", 55), ("b1_hybrid", 60), ("c64_dense", 40), ("c64_hybrid", 50)]
# the default run: the forced stages replace the older b1/c64 ones (replay without forcing; --only runs them)
DEFAULT_STAGES = ("check_dense", "check_hybrid", "forced_dense", "forced_hybrid")
FORCED_P = (0.0, 0.6, 0.8)
TARGET_VERIFY = {"dense": 1.15, "hybrid": 1.25}


SMOKE = {DENSE: "tiny-llama", HYBRID: "tiny-qwen3-next"}  # --smoke: toy presets on the CPU


def cut(name: str, layers: int | None) -> str:
    """A random preset, cut to `layers` layers (registered in this process only)."""
    from lamina.models import presets

    if os.environ.get("SPEC_BENCH_SMOKE") == "1":
        name, layers = SMOKE[name], None

    if not layers or layers >= presets.PRESETS[name]["num_hidden_layers"]:
        return f"random:{name}"
    presets.PRESETS[f"{name}-{layers}l"] = dict(presets.PRESETS[name], num_hidden_layers=layers)
    return f"random:{name}-{layers}l"


def _device() -> list[str]:
    return ["--device", "cpu"] if os.environ.get("SPEC_BENCH_SMOKE") == "1" else []


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    _free()
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
                  warmup=False, **({"device": "cpu", "kv_cache_memory_gb": 0.05} if _device() else
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
        if kind == "hybrid" and not _device():  # hybrid verify steps must have replayed verify graphs
            ok = ok and runs["replay"]["graph_picks"]["verify"] > 0
        result[kind] = {"model": model, "runs": runs, "ok": ok}
        print(kind, json.dumps(result[kind]), flush=True)
    return result


# ---- timings -------------------------------------------------------------------------------------------------
class _HostEvent:
    """torch.cuda.Event's interface from the host clock (--smoke on a CPU)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        return 1e3 * (end.t - self.t)


class ForwardTimer:
    """CUDA events around every ModelRunner.execute (graph input copies, replay or eager forward, lm_head), by
    runner (the plain engine's first, then the speculative one's) and step shape (tokens, sequences)."""

    def __init__(self) -> None:
        import torch

        from lamina.engine.runner import ModelRunner

        self.records: list = []
        self.num_runners = 0
        self.label = None  # the run the next forwards belong to (stage_forced)
        self.by_label: list = []
        orig = ModelRunner.execute
        timer = self

        def execute(runner, batch):
            if not hasattr(runner, "timer_index"):  # (an id() could be reused once the plain engine is freed)
                runner.timer_index, timer.num_runners = timer.num_runners, timer.num_runners + 1
            cuda = torch.cuda.is_available()
            start, end = ((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda
                          else (_HostEvent(), _HostEvent()))
            start.record()
            out = orig(runner, batch)
            end.record()
            timer.records.append((runner.timer_index, batch.input_ids.shape[0], batch.ctx.attn.num_seqs, start, end))
            if timer.label is not None:
                timer.by_label.append((timer.label, batch.input_ids.shape[0], batch.ctx.attn.num_seqs, start, end))
            return out
        ModelRunner.execute = execute

    def median_ms(self, engine: int, tokens: int, seqs: int) -> float | None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for r, t, b, s, e in self.records if (r, t, b) == (engine, tokens, seqs))
        return times[len(times) // 2] if times else None


    def forwards_of(self, label: str) -> dict:
        """Every forward of run `label`: their total and largest device time (step time minus this is host time
        the step loop did not overlap; one huge forward is an eager fallback) and the spec run's own decode
        forwards' median (the table's decode column is the plain run's)."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times = [s.elapsed_time(e) for lb, t, b, s, e in self.by_label if lb == label]
        return {"forward_total_ms": round(sum(times), 2), "forward_max_ms": round(max(times, default=0.0), 3),
                "num_forwards": len(times)}

    def median_ms_of(self, label: str, tokens: int, seqs: int) -> float | None:
        """Median forward time of run `label`'s steps of exactly this shape (None: no such step)."""
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for lb, t, b, s, e in self.by_label if (lb, t, b) == (label, tokens, seqs))
        return times[len(times) // 2] if times else None


# ---- forced acceptance: plain and speculative in one engine ---------------------------------------------------
def _forced_sizes() -> dict:
    if _device():  # --cpu-smoke: toy sizes, the same logic
        return {"batch": (1, 4), "input_len": 8, "output_len": 10, "kv_gb": 0.05, "dtype": "float32"}
    return {"batch": (1, 64), "input_len": 128, "output_len": 128, "kv_gb": 8, "dtype": "bfloat16"}


def _timed(llm, prompts: list[list[int]], output_len: int, label: str, timer: ForwardTimer, reset=None) -> dict:
    """One warm-up pass (other first tokens: no prefix-cache hits) then one timed pass of greedy decoding;
    reset() before each pass (fresh gates: the timed pass pays the verify steps before a pause too)."""
    import torch

    from lamina import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    eng = llm.engine
    cuda = torch.cuda.is_available()
    steps = [0]
    step = eng.step

    def counted():
        steps[0] += 1
        return step()
    out = None
    for warm in (True, False):
        batch = [{"prompt_token_ids": [(p[0] + (1 if warm else 0)) % 1000] + p[1:]} for p in prompts]
        if reset is not None:
            reset()
        st0 = eng.stats()
        timer.label, steps[0] = (None if warm else label), 0
        eng.step = counted
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = llm.generate(batch, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        eng.step = step
        timer.label = None
        out = [r.outputs[0].token_ids for r in res]
    st = eng.stats()
    if eng.spec is not None:  # the gates' own counters (fresh each pass): pauses of the timed pass
        st.num_spec_pauses, st.num_spec_batch_pauses = eng.spec.gate.num_pauses, eng.spec.batch_gate.num_pauses
        st0.num_spec_pauses = st0.num_spec_batch_pauses = 0
    drafts = st.num_spec_drafts - st0.num_spec_drafts
    accepted = st.num_spec_accepted_tokens - st0.num_spec_accepted_tokens
    return {"elapsed_s": elapsed, "output_tok_s": len(prompts) * output_len / elapsed, "steps": steps[0],
            "step_ms": 1e3 * elapsed / max(1, steps[0]), "verify_runs": drafts,
            "acceptance_rate": accepted / max(1, st.num_spec_draft_tokens - st0.num_spec_draft_tokens),
            "mean_accepted_length": 1 + accepted / max(1, drafts),
            "pauses": st.num_spec_pauses - st0.num_spec_pauses,
            "batch_pauses": st.num_spec_batch_pauses - st0.num_spec_batch_pauses, "outputs": out}


def stage_forced(args, kind: str) -> dict:
    """Plain decode, then forced acceptance at each p (gate off) and p = 0 with the default gate, batch 1 and
    the large batch, all in one engine (see the module docstring)."""
    import random

    import torch

    from lamina import LLM
    from lamina.spec.adaptive import AcceptanceGate, BatchGate, GateSettings
    from lamina.spec.config import parse_speculative_config

    z = _forced_sizes()
    model = cut(DENSE, None) if kind == "dense" else cut(HYBRID, args.hybrid_layers)
    timer = ForwardTimer()
    torch.manual_seed(0)
    spec_cfg = parse_speculative_config({"method": "replay", "num_speculative_tokens": K, "acceptance_prob": 0.0,
                                         "forced": True, "min_acceptance_rate": 0}, bench=True)
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=z["dtype"], kv_cache_memory_gb=z["kv_gb"], max_num_seqs=max(z["batch"]),
              max_num_batched_tokens=2048, speculative_config=spec_cfg, progress=False,
              **({"device": "cpu"} if _device() else {}))
    eng = llm.engine
    spec = eng.spec
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    prompts = [[rng.randrange(1000, vocab) for _ in range(z["input_len"])] for _ in range(max(z["batch"]))]
    result = {"model": model, "k": K, "start_s": round(time.perf_counter() - t0, 1), "dtype": z["dtype"],
              "cuda_graphs": eng.runner.graphs is not None, "input_len": z["input_len"],
              "output_len": z["output_len"], "runs": {}}
    runs = result["runs"]
    # graph picks of each run (eager: None): a spec run's steps must replay graphs as the plain run's do
    picks: dict = {}
    graphs = eng.runner.graphs
    if graphs is not None:  # can_run: once per step (run() picks again)
        def counted(batch, pick=graphs.pick):
            key = pick(batch)
            kind = "eager" if key is None else "verify" if key.verify else "decode" if key.decode else "mixed"
            if timer.label is not None:  # the timed pass
                picks[kind] = picks.get(kind, 0) + 1
            return key is not None
        graphs.can_run = counted
    for b in z["batch"]:
        eng.spec = None  # plain decoding in the same engine (weights, graphs, pool)
        picks.clear()
        plain = _timed(llm, prompts[:b], z["output_len"], f"plain_b{b}", timer)
        plain.update(timer.forwards_of(f"plain_b{b}"), graph_picks=dict(picks))
        eng.spec = spec
        # the plain run's outputs are the drafts' reference (forced acceptance keeps the output on it)
        spec.proposer.reference.update({tuple([(p[0] + w) % 1000] + p[1:]): o for p, o in zip(prompts[:b],
                                        plain.pop("outputs")) for w in (0, 1)})
        runs[f"plain_b{b}"] = plain
        decode_ms = timer.median_ms_of(f"plain_b{b}", b, b)
        for p, gated in [(p, False) for p in FORCED_P] + [(0.0, True)]:
            label = f"p{p}{'_gated' if gated else ''}_b{b}"
            spec.proposer.p = p
            default = GateSettings()  # the engine's default gate (min_acceptance_rate 0.1) or off
            settings = default if gated else GateSettings(min_acceptance_rate=0.0)

            def fresh(settings=settings, spec=spec):
                spec.gate, spec.batch_gate = AcceptanceGate(settings), BatchGate(settings)
            picks.clear()
            r = _timed(llm, prompts[:b], z["output_len"], label, timer, fresh)
            r.pop("outputs")
            r.update(timer.forwards_of(label), own_decode_forward_ms=timer.median_ms_of(label, b, b),
                     graph_picks=dict(picks))
            verify_ms = timer.median_ms_of(label, b * (K + 1), b)
            r.update({"p": p, "gated": gated, "expected_mean_accepted_length": 1 + p + p * p + p ** 3,
                      "speedup": plain["elapsed_s"] / r["elapsed_s"], "decode_forward_ms": decode_ms,
                      "verify_forward_ms": verify_ms,
                      "verify_over_decode": verify_ms / decode_ms if verify_ms and decode_ms else None})
            runs[label] = r
            print(label, json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}), flush=True)
    result["targets"] = {"verify_over_decode_b1": TARGET_VERIFY[kind], "speedup_p0.8_b1": 2.3,
                         "loss_p0_b64": 0.05}
    del llm, eng, spec
    _free()
    return result


def _bench(args, command: str, model: str, spec: dict, extra: list[str], out: Path) -> dict:
    from lamina.cli import main

    path = out / f"bench_{command}_{model.split(':')[1]}.json"
    smoke = bool(_device())
    argv = ["bench", command, "--model", model, "--dtype", "float32" if smoke else "bfloat16",
            "--kv-cache-memory-gb", "0.05" if smoke else "8",
            "--speculative-config", json.dumps(spec), "--result-file", str(path), *_device(), *extra]
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
    for kind in ("dense", "hybrid"):
        f = res.get(f"forced_{kind}")
        if f and "error" not in f:
            for label, r in f["runs"].items():
                if not label.startswith("plain"):
                    lines.append(f"forced {kind:6s} {label:14s} {r['speedup']:.2f}x plain, acceptance "
                                 f"{r['acceptance_rate']:.2f}, mean len {r['mean_accepted_length']:.2f} "
                                 f"(exp {r['expected_mean_accepted_length']:.2f}), verify/decode forward "
                                 f"{_f(r['verify_over_decode'])}, pauses {r['pauses']}/{r['batch_pauses']}")
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


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _fwd(r: dict) -> str:
    """Device time of the run's forwards per engine step (the rest of step ms is host time not overlapped), its
    largest forward, and the steps that ran without a graph."""
    if "forward_total_ms" not in r:
        return " | "
    return (f"{r['forward_total_ms'] / max(1, r['steps']):.2f} ({r['forward_max_ms']:.1f}) | "
            f"{r.get('graph_picks', {}).get('eager', 0)}")


def markdown(res: dict) -> str:
    """The forced-acceptance tables (one per model) and the check verdicts, for BENCHMARKS.md."""
    lines = []
    for kind in ("dense", "hybrid"):
        f = res.get(f"forced_{kind}")
        if not f or "error" in f:
            continue
        lines += [f"### {f['model']} ({f['dtype']}, K = {f['k']}, CUDA graphs {f['cuda_graphs']}, "
                  f"{f['input_len']} prompt / {f['output_len']} output tokens, engine start {f['start_s']} s)", "",
                  "| run | batch | tok/s | vs plain | acceptance | mean accepted length (expected) | steps | "
                  "step ms | forward ms: verify / decode | pauses (seq / batch) | forward ms per step (max) | "
                  "eager steps |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, r in f["runs"].items():
            b = label.rsplit("_b", 1)[1]
            if label.startswith("plain"):
                lines.append(f"| plain | {b} | {r['output_tok_s']:.1f} | 1.00x | | | {r['steps']} | "
                             f"{r['step_ms']:.2f} | | | {_fwd(r)} |")
                continue
            name = f"forced p = {r['p']}" + (" (default gate)" if r["gated"] else " (gate off)")
            lines.append(f"| {name} | {b} | {r['output_tok_s']:.1f} | {r['speedup']:.2f}x | "
                         f"{r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} "
                         f"({r['expected_mean_accepted_length']:.2f}) | {r['steps']} | {r['step_ms']:.2f} | "
                         f"{_f(r['verify_forward_ms'], '.3f')} / {_f(r['decode_forward_ms'], '.3f')} = "
                         f"{_f(r['verify_over_decode'])}x | {r['pauses']} / {r['batch_pauses']} | {_fwd(r)} |")
        lines.append("")
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
