"""The child side of `--baseline vllm`: runs one vLLM engine on a job file and prints one result line.

Run as `python -m lamina.bench.vllm_runner JOB.json` by lamina/bench/vllm_baseline.py, in the parent's Python
and environment. It imports only the standard library and vLLM, so what it times is vLLM alone.

Job file (JSON): {"engine": {keyword arguments of vllm.LLM}, "rounds": [round, ...]}, each round
{"prompts": [[token id, ...], ...], "max_tokens": [n, ...], "temperature": t, "stream": bool}. Rounds run one
after the other on the same engine (warm-ups are rounds too; the parent decides which to count).
- stream false: one `LLM.generate` call over the round's prompts (what `lamina bench throughput` times).
- stream true: every prompt added to the engine at once, then engine steps until all finish, noting when each
  request's first token arrives (what lamina's latency and prefix benches time with their own engine).

Result: stdout gets exactly one line `RESULT_MARKER {json}`; the JSON is {"vllm_version", "startup_s" (building
the engine: load, compile, profile, graph capture), "rounds": [{"elapsed_s",
"output_tokens": [per prompt], "ttft_s": [per prompt, stream rounds only], "cached_tokens": [per prompt]}]}
or {"error": "one line"} (then the exit status is 1; 2 when vLLM is not importable).
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

RESULT_MARKER = "LAMINA_VLLM_RESULT"


def _emit(payload: dict[str, Any]) -> None:
    sys.stdout.flush()
    print(RESULT_MARKER, json.dumps(payload), flush=True)


def _cached(out) -> int:
    return int(getattr(out, "num_cached_tokens", 0) or 0)


def _batch_round(llm, vllm_sp, rnd: dict) -> dict:
    params = [vllm_sp.SamplingParams(temperature=rnd["temperature"], max_tokens=n, ignore_eos=True)
              for n in rnd["max_tokens"]]
    prompts = [{"prompt_token_ids": p} for p in rnd["prompts"]]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": [len(o.outputs[0].token_ids) for o in outs],
            "cached_tokens": [_cached(o) for o in outs]}


def _stream_round(llm, vllm_sp, rnd: dict) -> dict:
    engine = llm.llm_engine
    n = len(rnd["prompts"])
    index: dict[str, int] = {}
    tokens, cached = [0] * n, [0] * n
    first: list[float | None] = [None] * n
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(zip(rnd["prompts"], rnd["max_tokens"])):
        # DELTA: each step's output carries only its new tokens (the first non-empty one is the first token).
        params = vllm_sp.SamplingParams(temperature=rnd["temperature"], max_tokens=max_tokens, ignore_eos=True,
                                        output_kind=vllm_sp.RequestOutputKind.DELTA)
        rid = f"lamina-bench-{i}"
        used = engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        index[rid] = i
        if isinstance(used, str):  # newer vLLM returns the id it actually uses
            index[used] = i
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = index.get(out.request_id)
            if i is None:
                continue
            new = sum(len(c.token_ids) for c in out.outputs)
            if new and first[i] is None:
                first[i] = time.perf_counter() - start
            tokens[i] += new
            cached[i] = max(cached[i], _cached(out))
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "output_tokens": tokens, "ttft_s": first, "cached_tokens": cached}


def run_job(job: dict) -> dict:
    """Runs every round of the job on one vLLM engine; returns the result payload."""
    import vllm
    import vllm.sampling_params as vllm_sp

    start = time.perf_counter()
    llm = vllm.LLM(**job["engine"])
    startup = time.perf_counter() - start
    rounds = [(_stream_round if rnd.get("stream") else _batch_round)(llm, vllm_sp, rnd) for rnd in job["rounds"]]
    return {"vllm_version": getattr(vllm, "__version__", "unknown"), "startup_s": startup, "rounds": rounds}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        _emit({"error": "usage: python -m lamina.bench.vllm_runner JOB.json"})
        return 1
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or a broken install failing inside its own imports
        _emit({"error": f"vLLM is not importable by {sys.executable}: {type(e).__name__}: {e}".replace("\n", " ")})
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    try:
        payload = run_job(job)
    except Exception as e:
        _emit({"error": f"vLLM failed: {type(e).__name__}: {e}".replace("\n", " ")[:2000]})
        return 1
    _emit(payload)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
