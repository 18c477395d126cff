"""scripts/gpu_quant_quality.py end to end on the CPU with a tiny random checkpoint and a short text: every row
runs (checkpoints quantized, loaded and scored), the JSON is complete, and the checkpoint route with
round-to-nearest FP8 gives the online FP8 row's perplexity (the same weights by two routes)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_quant_quality.py"
WORDS = ("the king is dead and the queen is gone but the play goes on while the ghost walks the wall "
         "at night and the prince speaks to the moon of all that was and will be ").split()


def _script():
    spec = importlib.util.spec_from_file_location("gpu_quant_quality", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quality_pipeline_runs_every_row_on_the_cpu(checkpoints, tmp_path, one_thread, monkeypatch):
    import random

    rng = random.Random(0)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(rng.choice(WORDS) for _ in range(400)))
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    args = ["--model", str(checkpoints["llama"]), "--device", "cpu", "--text", str(text), "--calib-text", str(text),
            "--max-tokens", "160", "--window", "64", "--stride", "32", "--calib-tokens", "96", "--seq-len", "32",
            "--groups", "32", "--no-bf16", "--kv-cache-memory-gb", "0.05", "--budget", "600"]
    assert _script().main(args) == 0
    res = json.loads((out / "quant_quality.json").read_text())
    rows = {r["label"]: r for r in res["rows"]}
    assert list(rows) == ["fp32", "fp8-weights-online", "fp8-kv", "fp8-weights-gptq", "int4-rtn-g32", "int4-gptq-g32",
                          "int4-gptq-g32-mse", "int4-gptq-g32-in-order", "int4-rtn-g32-mse",
                          "fp8-weights-rtn-ckpt"]  # no GGUF row: the source is not a GGUF
    for label, r in rows.items():
        assert "error" not in r and "skipped" not in r, (label, r)
        assert r["tokens_scored"] == 159 and 1 < r["perplexity"] < 1e6
    assert "vs_ref_pct" not in rows["fp32"] and all("vs_ref_pct" in r for k, r in rows.items() if k != "fp32")
    assert rows["fp8-weights-rtn-ckpt"]["nll"] == pytest.approx(rows["fp8-weights-online"]["nll"], abs=1e-5)
    assert rows["int4-gptq-g32"]["quantize_s"] > 0


def test_prepare_and_plan(tmp_path):
    mod = _script()
    args = mod.parse_args(["--groups", "32,64"])
    labels = [r["label"] for r in mod.row_plan(args, gguf=True)]
    assert labels[:3] == ["fp32", "fp8-weights-online", "fp8-kv"] and "gguf-q4_1-packed" in labels
    assert {"int4-gptq-g32", "int4-rtn-g64", "bf16-fp8-weights-gptq"} <= set(labels)
    assert [r["label"] for r in mod.row_plan(mod.parse_args(["--only", "fp32,fp8-kv"]), gguf=True)] == ["fp32",
                                                                                                      "fp8-kv"]
