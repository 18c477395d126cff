"""`lamina bench serve`: load any OpenAI-compatible server with streaming requests; report request/token
throughput and TTFT, TPOT, ITL, end-to-end latency (mean, p50, p90, p99) and failures.

--max-concurrency takes a comma list (1,4,16,64) to sweep; --plot draws the sweep. Arrivals are Poisson at
--request-rate (inf: all at once, the concurrency cap does the pacing). ignore_eos is sent as an extra body
field so every output has the asked length (servers that do not know it ignore it).

--num-clients N splits each run over N client processes (serve_multi.py), so that one Python process parsing
every streamed chunk does not cap what is measured; --fake-server loads a server with no model
(fake_server.py) instead, which measures the client's own ceiling.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time

import httpx

from lamina.bench.serve_client import BenchRequest, RequestResult, Target, make_requests, send
from lamina.bench.serve_stats import RunSummary, format_summary, summarize


def add_serve_bench_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser("serve", help="load an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="model name (default: the server's first in /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key ($OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (ids) or words (words)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    p.add_argument("--prompt-type", choices=["ids", "words"], default="ids",
                   help="random token ids (exact lengths) or random common words (any endpoint/tokenizer)")
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn from [1000, vocab-size)")
    p.add_argument("--max-concurrency", default=None, help="cap on requests in flight; a comma list sweeps")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let requests stop at EOS")
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain every request's output to this JSON schema (structured_outputs.json); compare "
                        "its TPOT with a run without it")
    p.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not counted) before each run")
    p.add_argument("--seed", type=int, default=0, help="prompts of sweep point i use seed + i")
    p.add_argument("--same-prompts", action="store_true", help="reuse the same prompts at every sweep point")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout (s)")
    p.add_argument("--result-file", default=None, help="write the results as JSON")
    p.add_argument("--plot", default=None, help="PNG of latency percentiles vs concurrency (with a sweep)")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--num-clients", type=int, default=1,
                   help="client processes sharing each run (requests, concurrency and rate divided among them)")
    p.add_argument("--fake-server", action="store_true",
                   help="load a trivial streaming server with no model instead (lamina.bench.fake_server): the "
                        "client's own ceiling; --base-url is ignored")
    p.add_argument("--fake-server-workers", type=int, default=1, help="--fake-server: server processes")
    p.add_argument("--fake-step-ms", type=float, default=0.0, help="--fake-server: pause between two tokens")
    p.set_defaults(func=cmd_serve_bench)


def parse_concurrency(text: str | None) -> list[int | None]:
    if text is None or text.strip().lower() in ("", "none", "inf"):
        return [None]
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise ValueError(f"bad --max-concurrency {text!r}")
    return values


async def drive(client: httpx.AsyncClient, target: Target, reqs: list[BenchRequest], concurrency: int | None,
                rate: float, seed: int, bar=None) -> list[RequestResult]:
    """Sends reqs (Poisson arrivals at rate, at most concurrency in flight); returns their results in order."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(req: BenchRequest) -> RequestResult:
        if sem is None:
            res = await send(client, target, req)
        else:
            async with sem:
                res = await send(client, target, req)
        if bar is not None:
            bar.update(1)
        return res

    rng = random.Random(seed)
    tasks = []
    for req in reqs:
        tasks.append(asyncio.create_task(one(req)))
        if math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def http_client(pool: int, timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits)


async def warm_up(client: httpx.AsyncClient, target: Target, reqs: list[BenchRequest], n: int) -> None:
    """n requests (cycling through reqs), not counted."""
    if n and reqs:
        await asyncio.gather(*(send(client, target, reqs[i % len(reqs)]) for i in range(n)))


async def run_once(target: Target, reqs: list[BenchRequest], concurrency: int | None, rate: float, seed: int,
                   timeout: float, progress: bool, warmups: int = 0) -> RunSummary:
    from tqdm import tqdm

    async with http_client(concurrency or len(reqs), timeout) as client:
        await warm_up(client, target, reqs, warmups)
        bar = tqdm(total=len(reqs), desc=f"concurrency {concurrency or 'max'}", unit="req", disable=not progress)
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = await drive(client, target, reqs, concurrency, rate, seed, bar)
        duration = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        bar.close()
    summary = summarize(results, duration, concurrency, rate)
    summary.client_cpu_frac = [cpu / duration]
    return summary


def _server_model(base_url: str, headers: dict) -> str:
    r = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


_GAUGES = (":num_requests_", ":kv_cache_")
_COUNTERS = (":prompt_tokens", ":generation_tokens", ":prefix_cache_")


def server_metrics(base_url: str) -> dict[str, float]:
    """Request/KV gauges and token/prefix-cache counters from the server's /metrics (lamina: or vllm: names),
    if it has them."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(base_url + "/metrics", timeout=10)
        if r.status_code != 200:
            return {}
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(r.text):
            wanted = _GAUGES if fam.type == "gauge" else _COUNTERS if fam.type == "counter" else ()
            if any(w in fam.name for w in wanted):
                for s in fam.samples:
                    if not s.name.endswith("_created"):
                        out[s.name] = out.get(s.name, 0.0) + s.value
        return out
    except (httpx.HTTPError, ValueError):
        return {}


def cmd_serve_bench(args: argparse.Namespace) -> int:
    if not args.fake_server:
        return _bench(args, args.base_url)
    from lamina.bench import fake_server

    port = fake_server.free_port()
    procs = fake_server.start(port, args.fake_server_workers, args.fake_step_ms)
    try:
        return _bench(args, f"http://127.0.0.1:{port}")
    finally:
        fake_server.stop(procs)


def request_extras(extra_body: str, json_schema: str | None) -> dict:
    """--extra-body plus, with --json-schema, the schema as the request's structured output."""
    extra = json.loads(extra_body)
    if json_schema is not None:
        with open(json_schema) as f:
            extra["structured_outputs"] = {"json": json.load(f)}
    return extra


def _bench(args: argparse.Namespace, base_url: str) -> int:
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    key_headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or _server_model(base, key_headers)
    target = Target(base, model, args.endpoint, args.api_key, args.ignore_eos, args.temperature,
                    request_extras(args.extra_body, args.json_schema))
    runs: list[RunSummary] = []
    for i, conc in enumerate(parse_concurrency(args.max_concurrency)):
        # Fresh prompts for each sweep point (drawn the same way): a server's prefix cache must not turn the
        # later points' prefills into cache hits.
        seed = args.seed if args.same_prompts else args.seed + i
        reqs = make_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.prompt_type,
                             args.vocab_size, seed)
        before = server_metrics(base)
        if args.num_clients > 1:
            from lamina.bench.serve_multi import run_multi

            summary = run_multi(target, reqs, conc, args.request_rate, seed, args.timeout, args.num_clients,
                                args.num_warmups)
        else:
            summary = asyncio.run(run_once(target, reqs, conc, args.request_rate, seed, args.timeout,
                                           not args.disable_tqdm, args.num_warmups))
        after = server_metrics(base)
        summary.server_counters = {k: after[k] - before.get(k, 0.0) for k in after
                                   if any(c in k for c in _COUNTERS)}
        print(format_summary(summary), flush=True)
        if summary.client_cpu_frac and max(summary.client_cpu_frac) > 0.8:
            print(f"warning: a client process was busy {max(summary.client_cpu_frac):.0%} of the run, so these "
                  "figures may be the client's: try more --num-clients", flush=True)
        runs.append(summary)
    gauges = {k: v for k, v in server_metrics(base).items() if any(g in k for g in _GAUGES)}
    if gauges:
        print("server after the run: " + ", ".join(f"{k}={v:g}" for k, v in sorted(gauges.items())))
    result = {"command": "serve", "base_url": base, "model": model, "endpoint": args.endpoint,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "range_ratio": args.range_ratio, "prompt_type": args.prompt_type, "ignore_eos": args.ignore_eos,
              "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
              "temperature": args.temperature, "num_clients": args.num_clients, "fake_server": args.fake_server,
              "runs": [r.to_dict() for r in runs], "server_gauges_after": gauges}
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        from lamina.bench.serve_plot import plot_sweep

        plot_sweep(runs, args.plot, f"{model} via {base} ({args.endpoint}, in {args.input_len} / out "
                                    f"{args.output_len} tokens, {args.num_prompts} prompts)")
    return 0 if all(r.failed == 0 for r in runs) else 1
