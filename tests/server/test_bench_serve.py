"""`lamina bench serve` against the test server: counts, lengths and the sweep's JSON and plot."""
from __future__ import annotations

import argparse
import json

import pytest
from server_helpers import wait_idle

from lamina.bench.serve import add_serve_bench_parser, parse_concurrency
from lamina.cli import build_parser


def test_parse_concurrency():
    assert parse_concurrency(None) == [None]
    assert parse_concurrency("1,4, 16") == [1, 4, 16]
    with pytest.raises(ValueError):
        parse_concurrency("0,2")


@pytest.mark.parametrize("prompt_type,endpoint", [("ids", "completions"), ("words", "chat")])
def test_bench_sweep(server, tmp_path, prompt_type, endpoint):
    parser = argparse.ArgumentParser()
    add_serve_bench_parser(parser.add_subparsers())
    result, plot = tmp_path / "r.json", tmp_path / "p.png"
    args = parser.parse_args(["serve", "--base-url", server.base_url, "--num-prompts", "6", "--input-len", "16",
                              "--output-len", "4", "--range-ratio", "0.5", "--max-concurrency", "1,3",
                              "--prompt-type", prompt_type, "--endpoint", endpoint, "--vocab-size", "49152",
                              "--result-file", str(result), "--plot", str(plot), "--disable-tqdm"])
    assert args.func(args) == 0
    data = json.loads(result.read_text())
    assert [r["max_concurrency"] for r in data["runs"]] == [1, 3]
    outs = []
    for run in data["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["ttft_ms"]["p50"] > 0 and run["e2el_ms"]["p99"] >= run["ttft_ms"]["p99"]
        outs.append(run["total_output_tokens"])
        # the client's count (from usage) and the server's own counter agree
        assert run["server_counters"]["lamina:generation_tokens_total"] == run["total_output_tokens"]
    assert all(6 * 2 <= n <= 6 * 6 for n in outs)  # ignore_eos: exactly the drawn lengths (2..6 each)
    assert plot.stat().st_size > 10_000
    gauges = data["server_gauges_after"]
    assert gauges["lamina:kv_cache_free_blocks"] == gauges["lamina:kv_cache_total_blocks"]
    wait_idle(server.base_url)


def test_bench_is_wired_into_the_cli():
    args = build_parser().parse_args(["bench", "serve", "--max-concurrency", "1,2", "--num-clients", "2"])
    assert args.max_concurrency == "1,2" and args.num_clients == 2
