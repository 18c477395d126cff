"""The load client's own ceiling: `lamina bench serve --fake-server` (a streaming server with no model) and
`--num-clients N` (client processes sharing a run, results merged)."""
from __future__ import annotations

import json

import pytest

from lamina.bench.fake_server import free_port
from lamina.bench.serve_client import Target, make_requests
from lamina.bench.serve_multi import run_multi, split
from lamina.cli import main


def test_split_deals_requests_caps_and_rates():
    reqs = make_requests(10, 8, 4, 0.0, "ids", 32000, 0)
    shares = split(reqs, 5, 6.0, 7, 0, 3)
    assert [len(s.reqs) for s in shares] == [4, 3, 3]
    assert sorted(id(r) for s in shares for r in s.reqs) == sorted(id(r) for r in reqs)
    assert [s.concurrency for s in shares] == [2, 2, 1] and [s.warmups for s in shares] == [3, 2, 2]
    assert sum(s.rate for s in shares) == pytest.approx(6.0) and len({s.seed for s in shares}) == 3
    assert len(split(reqs, 2, 1.0, 0, 0, 8)) == 2  # never more clients than the cap allows
    assert len(split(reqs[:3], None, 1.0, 0, 0, 8)) == 3  # ... or than requests
    assert [s.concurrency for s in split(reqs, None, 1.0, 0, 0, 2)] == [None, None]


def _serve(tmp_path, *extra) -> tuple[int, dict]:
    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--fake-server", "--num-prompts", "12", "--input-len", "16", "--output-len", "5",
               "--disable-tqdm", "--result-file", str(out), *extra])
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("endpoint,prompt_type", [("completions", "ids"), ("chat", "words")])
def test_fake_server_one_client(tmp_path, endpoint, prompt_type):
    rc, r = _serve(tmp_path, "--endpoint", endpoint, "--prompt-type", prompt_type, "--max-concurrency", "4")
    assert rc == 0 and r["fake_server"] and r["model"] == "fake"
    run = r["runs"][0]
    assert run["completed"] == 12 and run["failed"] == 0 and run["total_output_tokens"] == 12 * 5
    assert run["total_input_tokens"] == 12 * 16  # ids: each id a token; words: each word a token
    assert 0 < run["ttft_ms"]["p50"] <= run["e2el_ms"]["p50"] and len(run["client_cpu_frac"]) == 1


def test_fake_server_several_clients_and_workers(tmp_path):
    rc, r = _serve(tmp_path, "--num-clients", "3", "--fake-server-workers", "2", "--max-concurrency", "6,3",
                   "--num-warmups", "2")
    assert rc == 0 and r["num_clients"] == 3
    for run in r["runs"]:
        assert run["completed"] == 12 and run["failed"] == 0 and run["total_output_tokens"] == 60
        assert run["num_clients"] == 3 and len(run["client_cpu_frac"]) == 3
        assert all(0 <= f for f in run["client_cpu_frac"]) and run["itl_ms"]["p50"] >= 0


def test_several_clients_against_no_server_fail_cleanly():
    target = Target(f"http://127.0.0.1:{free_port()}", "m", "completions", None, True, 0.0, {})
    summary = run_multi(target, make_requests(4, 8, 2, 0.0, "ids", 32000, 0), 4, float("inf"), 0, 5.0, 2)
    assert summary.completed == 0 and summary.failed == 4 and summary.errors


def test_a_failing_client_process_is_reported():
    """A client that fails before the start (here: a body it cannot encode, in its warm-up) breaks the
    barrier; the run fails with that client's message instead of waiting for it."""
    target = Target(f"http://127.0.0.1:{free_port()}", "m", "completions", None, True, 0.0, {"x": {1, 2}})
    with pytest.raises(RuntimeError, match="client process .* failed: TypeError"):
        run_multi(target, make_requests(4, 8, 2, 0.0, "ids", 32000, 0), 4, float("inf"), 0, 5.0, 2, warmups=2)
