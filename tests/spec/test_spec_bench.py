"""`lamina bench latency|throughput --speculative-config`: both runs in one report, the replay proposer's
acceptance as set (1.0: every draft stands; 0.0: none does), greedy outputs identical either way."""
from __future__ import annotations

import json

import pytest

from lamina.cli import main

TINY = ["--model", "random:tiny-llama", "--device", "cpu", "--kv-cache-memory-gb", "0.02", "--max-num-seqs", "8"]
SPEC = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']


@pytest.mark.parametrize("p", [1.0, 0.0])
def test_latency_replay(tmp_path, p, one_thread):
    out = tmp_path / "r.json"
    assert main(["bench", "latency", *TINY, *SPEC, "--input-len", "8", "--output-len", "17", "--repeats", "1",
                 "--replay-acceptance", str(p) if p else "0.000001", "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["greedy_outputs_identical"] is True
    assert r["plain"]["output_tok_s"] > 0 and r["spec"]["output_tok_s"] > 0
    assert r["speedup"] == pytest.approx(r["plain"]["elapsed_s"] / r["spec"]["elapsed_s"])
    if p == 1.0:
        assert r["acceptance_rate"] == 1.0 and r["mean_accepted_length"] > 3
        assert r["accepted_per_position"][0] == 1.0
    else:
        assert r["acceptance_rate"] == 0.0 and r["mean_accepted_length"] == 1.0
        assert r["num_pauses"] >= 1  # the drafts never stand: drafting pauses (spec/adaptive.py)


def test_throughput_with_text_prompts(tmp_path, checkpoints, one_thread):
    text = tmp_path / "play.txt"
    text.write_text("header\n" * 20 + "To be, or not to be, that is the question:\n" * 40)
    out = tmp_path / "r.json"
    model = ["--model", str(checkpoints["llama"]), *TINY[2:]]
    assert main(["bench", "throughput", *model, *SPEC, "--num-prompts", "3", "--input-len", "20", "--output-len",
                 "8", "--prompt-text", str(text), "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["num_prompts"] == 3 and r["greedy_outputs_identical"] is True and r["num_drafts"] >= 0
