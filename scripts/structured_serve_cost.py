"""Where structured output's time goes on the real server path: `lamina serve` with a per-phase timer in its
engine core, loaded by `lamina bench serve` with and without a JSON schema at each concurrency.

The server runs as a child of this script, with CoreProcess patched so the spawned core process wraps the
engine's phases in timers (nothing in lamina changes): the core loop's own time, the step, the batch build,
the forward, the sampler (inside it the bitmask apply), reading a step back (that includes waiting for the
device), the grammars' accept, the bitmask (inside it the fill and the host-to-device copy; with the
overlapped fill its start, the step loop's wait for it and the fill summed over the filler's threads), and per
request the constraint check, grammar hold/attach and compilation (on the compiler's worker thread). Steps
are grouped by (constrained or not, sampled rows); the core writes its totals whenever it goes idle, and
each bench run's share is the difference. It also reads both processes' CPU time (/proc) per run.

Reading it: `period` is step start to step start in the core. TPOT near `period`: the core is the limit, and
its phases say where; TPOT far above `period`: the tokens wait outside the core (IPC, the API server, the
client). On a GPU, without --sync, `forward` and `sample` are launch times and waiting for the device shows
in `resolve` (reading a step back).

On the H200 (about 2 minutes with the server's start):
  python3 -m lamina.cli bench save-random qwen3-0.6b /tmp/ck06 --tokenizer .gpu/tok
  python3 scripts/structured_serve_cost.py --model /tmp/ck06 --device cuda --input-len 512 --output-len 256 \
      --result-file $OUT/structured_phases.json

  python scripts/structured_serve_cost.py [--model CKPT] [--device cpu|cuda] [--concurrency 1,64]
      [--input-len 128] [--output-len 64] [--sync]

Without --model a tiny random Qwen3 (vocab 151,936, hidden 16, one layer) with the Qwen3 tokenizer of
--tokenizer is written to /tmp first: the model is nearly free, so what remains is the per-token machinery.
--sync synchronizes the device around the forward and the sampler so they show device time (it removes the
overlap of host and device work, so compare phases, not TPOT, under it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the spawned core unpickles timed_core_main from here
from structured_core_timers import timed_core_main  # noqa: E402

SCHEMA = "scripts/schemas/bench_items.json"
# Fill settings switched inside one server between runs (MaskFiller attributes; structured/fill.py): default is
# the server's own (its environment), loop the opt-in accepts-on-the-loop path, min1 even one row in the
# background, nofill the fill on the step loop (no overlap); pipe structured/fill_pipe.py (one batch accept and
# one batch fill on a worker the loop does not wait for), pipesw the same with the switch interval at 200 us
# while a fill is pending, pipeloop with the batch accept on the loop.
VARIANTS = {"default": {}, "loop": {"accept_on_loop": True, "wait_start": False, "switch_us": 200.0, "min_rows": 1},
            "min1": {"min_rows": 1}, "nofill": {"threads": 0}, "pipe": {"pipe": True},
            "pipesw": {"pipe": True, "switch_us": 200.0}, "pipeloop": {"pipe": True, "accept_on_loop": True},
            # the pipe with even one row in the background; JSON whitespace bounded on the host
            # (LAMINA_JSON_WHITESPACE_ON_HOST, structured/whitespace.py: the core's compiler is rebuilt on a switch)
            # with the default fill, the pipe, or every fill on the loop (one xgrammar thread)
            "pipe1": {"pipe": True, "min_rows": 1}, "ws": {"ws_on_host": True},
            "wspipe": {"ws_on_host": True, "pipe": True}, "wsnofill": {"ws_on_host": True, "threads": 0}}


def _serve_child(argv: list[str], path: str, sync: bool) -> int:
    """The server process: lamina's CLI, with the core spawned through timed_core_main."""
    import logging
    import multiprocessing

    from lamina.engine import core_proc

    def start(self, addrs):
        mp = multiprocessing.get_context("spawn")
        level = logging.getLogger("lamina").getEffectiveLevel()
        self.proc = mp.Process(target=timed_core_main, args=(self.config, addrs, os.getpid(), level, path, sync),
                               name="lamina-core", daemon=True)
        self.proc.start()

    core_proc.CoreProcess.start = start
    from lamina.cli import main

    return main(argv)


# ---- the driver ---------------------------------------------------------------------------------------------
def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return 0.0


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def make_tiny(tokenizer: str, out: str) -> str:
    import shutil

    import torch
    import transformers

    if (Path(out) / "model.safetensors").is_file():
        return out
    cfg = transformers.Qwen3Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                                   tie_word_embeddings=True, max_position_embeddings=4096, eos_token_id=151645,
                                   bos_token_id=151643)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer) / f, Path(out) / f)
    return out


def _diff(new: dict, old: dict) -> dict:
    out = {}
    for key, agg in new.get("steps", {}).items():
        prev = old.get("steps", {}).get(key, {})
        d = {k: v - prev.get(k, 0.0) for k, v in agg.items()}
        if d.get("steps", 0) > 0:
            out[key] = d
    return out


def _read(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _wait_idle(path: str, before: float, timeout: float = 30.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            if os.path.getmtime(path) > before:
                time.sleep(0.5)
                return
        except OSError:
            pass
        time.sleep(0.2)


def _report(label: str, steps: dict, tpot: float | None, cpu: dict) -> dict:
    """The dominant step shape's phases in microseconds per step."""
    if not steps:
        print(f"{label}: no steps recorded")
        return {}
    key, agg = max(steps.items(), key=lambda kv: kv[1]["steps"])
    n = agg["steps"]
    phases = {k: agg[k] / n * 1e6 for k in agg if not k.endswith("_n") and k != "steps"}
    order = ["period", "loop", "gc", "step", "prepare", "forward", "sample", "apply", "resolve", "accept",
             "bitmask", "mask_start", "host_buf", "filler_start", "split", "accept_all", "fill", "fill_row",
             "mask_result", "fill_wait", "h2d", "admit"]
    shown = " ".join(f"{k} {phases[k]:.0f}" for k in order if k in phases)
    per_tok = f"; core cpu ms/output token {cpu['core_ms_per_token']:.2f}" if cpu.get("core_ms_per_token") else ""
    print(f"{label}: TPOT p50 {tpot if tpot is None else round(tpot, 2)} ms; {int(n)} steps of {key}; "
          f"us/step: {shown}; cpu s server {cpu['server']:.1f} core {cpu['core']:.1f}{per_tok}", flush=True)
    return {"label": label, "tpot_p50_ms": tpot, "shape": key, "steps": n, "us_per_step": phases, "cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=".gpu/tok" if Path(".gpu/tok").is_dir() else "/work/main/.gpu/tok")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-client", type=int, default=2, help="prompts = this x concurrency (>= 4)")
    ap.add_argument("--schema", default=SCHEMA)
    ap.add_argument("--port", type=int, default=8219)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--serve-args", default="", help="extra `lamina serve` arguments")
    ap.add_argument("--vocab-size", type=int, default=151936, help="the random prompts' token range (the model's)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each side per concurrency, plain and schema interleaved (order alternating)")
    ap.add_argument("--label", default="", help="a name for this server's settings in the table")
    ap.add_argument("--variants", default="default", help=f"fill settings interleaved in one server: {list(VARIANTS)}")
    ap.add_argument("--result-file", default=None)
    if sys.argv[1:2] == ["--child"]:  # the server process (the rest is `lamina serve`'s command line)
        sys.exit(_serve_child(sys.argv[4:], sys.argv[2], sys.argv[3] == "1"))
    args = ap.parse_args()
    model = args.model or make_tiny(args.tokenizer, "/tmp/lamina_struct_tiny")
    concs = [int(c) for c in args.concurrency.split(",")]
    timing = f"/tmp/lamina_struct_timing_{os.getpid()}.json"
    serve = ["serve", model, "--port", str(args.port), "--device", args.device, "--max-num-seqs", str(max(concs)),
             "--no-enable-prefix-caching", *args.serve_args.split()]
    srv = subprocess.Popen([sys.executable, __file__, "--child", timing, "1" if args.sync else "0", *serve],
                           stdout=open("/tmp/lamina_struct_serve.log", "w"), stderr=subprocess.STDOUT)
    import urllib.request

    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=1)
                break
            except OSError:
                if srv.poll() is not None:
                    sys.exit("the server exited; see /tmp/lamina_struct_serve.log")
                time.sleep(0.5)
        results = []
        variants = args.variants.split(",")
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown:
            sys.exit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
        if args.repeats > 1:  # not counted: the first runs pay a collector pass of ~1.3 s (gc ~800 us/step over
            for schema in (None, args.schema):  # the first c=1 run, 2026-12-02) and the grammar's compilation
                _one_run(args, srv, timing, concs[0], schema)
        for c in concs:
            for rep in range(args.repeats):  # order alternating: drift in the host hits every side alike
                for variant in (variants if rep % 2 == 0 else variants[::-1]):
                    Path(timing + ".variant").write_text(json.dumps(VARIANTS[variant]))
                    for schema in ((None, args.schema) if rep % 2 == 0 else (args.schema, None)):
                        r = _one_run(args, srv, timing, c, schema, variant)
                        results.append({"concurrency": c, "repeat": rep, "variant": variant, **r})
        for variant in variants:
            _table([r for r in results if r["variant"] == variant], " ".join(filter(None, (args.label, variant))))
        req = _read(timing).get("requests", {})
        print("per request:", {k: round(v * 1e3, 3) if k.endswith("_s") else int(v) for k, v in req.items()},
              "(times in ms, totals)")
        if args.result_file:
            Path(args.result_file).write_text(json.dumps({"runs": results, "requests": req}, indent=1))
    finally:
        srv.terminate()
        srv.wait(30)


def _one_run(args, srv, timing: str, c: int, schema: str | None, variant: str = "default") -> dict:
    """One `lamina bench serve` run against the server: its TPOT p50 and the core's phases over it."""
    tag = "schema" if schema else "plain"
    out = f"/tmp/lamina_struct_bench_{tag}_{c}.json"
    before, t0 = _read(timing), time.time()
    core = (_children(srv.pid) or [0])[-1]
    cpu0 = {"server": _cpu_seconds(srv.pid), "core": _cpu_seconds(core)}
    cmd = [sys.executable, "-m", "lamina.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{args.port}",
           "--num-prompts", str(max(4, args.prompts_per_client * c)), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--max-concurrency", str(c), "--vocab-size", str(args.vocab_size),
           "--num-warmups", "2", "--disable-tqdm", "--result-file", out] + (["--json-schema", schema] if schema else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    _wait_idle(timing, t0)
    cpu = {"server": _cpu_seconds(srv.pid) - cpu0["server"], "core": _cpu_seconds(core) - cpu0["core"]}
    tokens = sum(r.get("total_output_tokens", 0) for r in _read(out).get("runs") or [_read(out)])
    if tokens:  # the core's CPU time per output token (the fill's threads included)
        cpu["core_ms_per_token"] = cpu["core"] / tokens * 1e3
    return {"side": tag, **_report(f"c={c} {tag} {variant}", _diff(_read(timing), before), _tpot(out), cpu)}


def _table(results: list[dict], label: str) -> None:
    """TPOT p50 per concurrency and side over the repeats (median, min-max), the schema's overhead on the
    medians and the median of the paired (same repeat) overheads, then each phase's median us/step."""
    import statistics

    print(f"TPOT p50 ms{f' ({label})' if label else ''}: median [min-max] over repeats; overhead = schema / plain - 1")
    print("| c | plain | schema | overhead (medians) | overhead (paired, median) | n |")
    print("|---|---|---|---|---|---|")
    for c in sorted({r["concurrency"] for r in results}):
        side = {k: [r for r in results if r["concurrency"] == c and r.get("side") == k and r.get("tpot_p50_ms")]
                for k in ("plain", "schema")}
        tp = {k: [r["tpot_p50_ms"] for r in v] for k, v in side.items()}
        if not tp["plain"] or not tp["schema"]:
            print(f"| {c} | no result | | | | |")
            continue
        med = {k: statistics.median(v) for k, v in tp.items()}
        pairs = {}
        for r in side["plain"] + side["schema"]:
            pairs.setdefault(r["repeat"], {})[r["side"]] = r["tpot_p50_ms"]
        paired = [p["schema"] / p["plain"] - 1 for p in pairs.values() if len(p) == 2]
        cell = {k: f"{med[k]:.3f} [{min(v):.3f}-{max(v):.3f}]" for k, v in tp.items()}
        print(f"| {c} | {cell['plain']} | {cell['schema']} | {(med['schema'] / med['plain'] - 1) * 100:+.1f}% | "
              f"{statistics.median(paired) * 100:+.1f}% | {len(tp['plain'])}+{len(tp['schema'])} |")
        for k, v in side.items():
            keys = sorted({p for r in v for p in r.get("us_per_step", {})})
            phases = {p: statistics.median([r["us_per_step"].get(p, 0.0) for r in v]) for p in keys}
            order = [p for p in ("period", "step", "prepare", "forward", "sample", "apply", "resolve", "mask_start",
                                 "host_buf", "filler_start", "split", "accept_all", "fill", "fill_wait",
                                 "mask_result", "h2d", "gc", "loop") if p in phases]
            print(f"  c={c} {k} us/step (median): " + " ".join(f"{p} {phases[p]:.0f}" for p in order))


def _tpot(path: str) -> float | None:
    r = _read(path)
    runs = r.get("runs") or [r]
    for run in runs:
        for k in ("tpot_p50_ms", "median_tpot_ms"):
            if k in run:
                return run[k]
        tp = run.get("tpot_ms") or run.get("tpot")
        if isinstance(tp, dict):
            return tp.get("p50")
    return None


if __name__ == "__main__":
    main()
