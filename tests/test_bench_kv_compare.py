"""`lamina bench throughput --compare-kv-dtypes` on the CPU: a tiny random model, bf16 weights, the KV pool fixed
at 16 bf16 blocks (256 tokens) and twelve ~56-token sequences, so the bf16 pool runs ~4 at a time and preempts;
the FP8 pool in the same bytes holds twice the tokens and runs at least as many sequences at once."""
from __future__ import annotations

import json

import pytest

from lamina.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_BYTES = 4 * 2 * 16 * 4 * 32 * 2  # tiny-llama: layers x (K, V) x block_size x KV heads x head_dim x bf16


def test_compare_kv_dtypes_reports_both_pools(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "throughput", "--model", "random:tiny-llama", "--device", "cpu", "--dtype", "bfloat16",
               "--kv-cache-memory-gb", str(16 * BLOCK_BYTES / 2**30), "--max-num-batched-tokens", "64",
               "--num-prompts", "12", "--input-len", "40:48", "--output-len", "8", "--compare-kv-dtypes",
               "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    auto, fp8 = r["auto"], r["fp8"]
    assert auto["kv_storage_dtype"] == "torch.bfloat16" and fp8["kv_storage_dtype"] == "torch.float8_e4m3fn"
    assert auto["kv_token_capacity"] == 256 and fp8["kv_token_capacity"] == 2 * auto["kv_token_capacity"]
    for side in (auto, fp8):
        assert side["output_tokens"] == 12 * 8 and side["num_steps"] > 0
        assert 0 < side["mean_running"] <= side["max_running"] <= 12 and side["num_preemptions"] >= 0
        assert side["output_tok_s"] > 0 and side["total_tok_s"] > side["output_tok_s"]
    assert fp8["max_running"] >= auto["max_running"]
    for key, ratio in r["ratio_fp8"].items():
        assert ratio == pytest.approx(fp8[key] / auto[key])
    assert r["ratio_fp8"]["kv_token_capacity"] == 2.0
    assert r["check_logprobs"]["finite"] and r["check_logprobs"]["tokens"] == 64 + 64
    shown = capsys.readouterr().out
    assert "KV pool tokens" in shown and "2.00x" in shown and "preemptions" in shown


def test_compare_kv_dtypes_refuses_a_baseline():
    with pytest.raises(SystemExit, match="lamina only"):
        main(["bench", "throughput", "--model", "random:tiny-llama", "--device", "cpu", "--compare-kv-dtypes",
              "--baseline", "hf"])
