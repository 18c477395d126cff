"""The forced-acceptance stages of scripts/gpu_spec_bench.py (forced_dense, forced_hybrid; its docstring says
what they measure) and the forward timer its b1 stages share: plain and speculative decoding in one engine."""
from __future__ import annotations

import json
import time

from spec_bench_models import DENSE, HYBRID, TARGET_VERIFY, K, cut, device_args, free_memory

FORCED_P = (0.0, 0.6, 0.8)


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
        the step loop did not overlap; one huge forward is an eager fallback)."""
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
def forced_sizes() -> dict:
    if device_args():  # --cpu-smoke: toy sizes, the same logic
        return {"batch": (1, 4), "input_len": 8, "output_len": 10, "kv_gb": 0.05, "dtype": "float32"}
    return {"batch": (1, 64), "input_len": 128, "output_len": 128, "kv_gb": 8, "dtype": "bfloat16"}


def timed(llm, prompts: list[list[int]], output_len: int, label: str, timer: ForwardTimer, reset=None) -> dict:
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

    z = forced_sizes()
    model = cut(DENSE, None) if kind == "dense" else cut(HYBRID, args.hybrid_layers)
    timer = ForwardTimer()
    torch.manual_seed(0)
    spec_cfg = parse_speculative_config({"method": "replay", "num_speculative_tokens": K, "acceptance_prob": 0.0,
                                         "forced": True, "min_acceptance_rate": 0}, bench=True)
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=z["dtype"], kv_cache_memory_gb=z["kv_gb"], max_num_seqs=max(z["batch"]),
              max_num_batched_tokens=2048, speculative_config=spec_cfg, progress=False,
              **({"device": "cpu"} if device_args() else {}))
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
        plain = timed(llm, prompts[:b], z["output_len"], f"plain_b{b}", timer)
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
            r = timed(llm, prompts[:b], z["output_len"], label, timer, fresh)
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
    free_memory()
    return result


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def forced_summary_lines(res: dict) -> list[str]:
    lines = []
    for kind in ("dense", "hybrid"):
        f = res.get(f"forced_{kind}")
        if f and "error" not in f:
            for label, r in f["runs"].items():
                if not label.startswith("plain"):
                    lines.append(f"forced {kind:6s} {label:14s} {r['speedup']:.2f}x plain, acceptance "
                                 f"{r['acceptance_rate']:.2f}, mean len {r['mean_accepted_length']:.2f} "
                                 f"(exp {r['expected_mean_accepted_length']:.2f}), verify/decode forward "
                                 f"{_f(r['verify_over_decode'])}, pauses {r['pauses']}/{r['batch_pauses']}")
    return lines


def _fwd(r: dict) -> str:
    """Device time of the run's forwards per engine step (the rest of step ms is host time not overlapped), its
    largest forward, and the steps that ran without a graph."""
    if "forward_total_ms" not in r:
        return " | "
    return (f"{r['forward_total_ms'] / max(1, r['steps']):.2f} ({r['forward_max_ms']:.1f}) | "
            f"{r.get('graph_picks', {}).get('eager', 0)}")


def forced_markdown(res: dict) -> list[str]:
    """The forced-acceptance tables, one per model."""
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
    return lines
