"""`lamina bench throughput | latency | prefix --baseline vllm` without vLLM: the not-importable message, the
engine arguments, and the child-process protocol end to end against tests/fake_vllm (a stand-in `vllm`
package with deterministic outputs), so the parsing, summaries, ratios and report are tested on the CPU."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import pytest

from lamina.bench import vllm_baseline
from lamina.cli import main

FAKE = str(Path(__file__).parent / "fake_vllm")
TINY = ["--model", "random:tiny-llama", "--device", "cpu", "--kv-cache-memory-gb", "0.02", "--max-num-seqs", "8"]


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path) -> Path:
    """Puts the fake vLLM on this process's path (for the find_spec check) and on the child's PYTHONPATH;
    returns the file where the fake logs each engine's arguments."""
    monkeypatch.syspath_prepend(FAKE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (FAKE, os.environ.get("PYTHONPATH")) if p))
    log = tmp_path / "fake_vllm_log.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    monkeypatch.delenv("FAKE_VLLM_FAIL", raising=False)
    return log


def _engine_ns(**over) -> argparse.Namespace:
    base = dict(max_num_seqs=64, max_num_batched_tokens=8192, gpu_memory_utilization=0.85, enforce_eager=False,
                seed=0, max_model_len=None, vllm_args="{}")
    return argparse.Namespace(**{**base, **over})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_not_importable_is_one_line_before_lamina_runs(capsys):
    with pytest.raises(SystemExit) as e:
        # The check comes before lamina loads its model (a missing path is the argument checks' to report).
        main(["bench", "throughput", "--model", "random:tiny-llama", "--baseline", "vllm"])
    msg = str(e.value.code)
    assert "vLLM" in msg and "cannot import" in msg and "\n" not in msg
    for cmd in (["latency"], ["prefix"]):
        with pytest.raises(SystemExit, match="needs vLLM"):
            main(["bench", *cmd, "--model", "random:tiny-llama", "--baseline", "vllm"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_child_reports_not_importable(tmp_path):
    with pytest.raises(vllm_baseline.VLLMBaselineError, match="vLLM is not importable") as e:
        vllm_baseline.run_vllm({"model": "x"}, [], tmp_path)
    assert "\n" not in str(e.value)


def test_gguf_and_bad_vllm_args_are_refused(fake_vllm, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit, match="not the GGUF model"):
        vllm_baseline.require_vllm(argparse.Namespace(model=str(gguf), vllm_args="{}"))
    for bad in ("{nope", "[1]"):
        with pytest.raises(SystemExit, match="--vllm-args"):
            vllm_baseline.require_vllm(argparse.Namespace(model="random:tiny-llama", vllm_args=bad))


def test_engine_args_random_preset_and_overrides(tmp_path):
    kw = vllm_baseline.engine_args("random:qwen3-0.6b", "bfloat16", _engine_ns(), tmp_path, False)
    cfg = json.loads((Path(kw["model"]) / "config.json").read_text())
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True and kw["dtype"] == "bfloat16"
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["gpu_memory_utilization"]) == (64, 8192, 0.85)
    assert kw["enable_prefix_caching"] is False and "max_model_len" not in kw and "additional_config" not in kw
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (28, 1024, 151936)

    ns = _engine_ns(max_model_len=4096, vllm_args='{"gpu_memory_utilization": 0.5, "max_num_seqs": 4}')
    kw = vllm_baseline.engine_args("random:tiny-qwen3-next", "bfloat16", ns, tmp_path / "b", True)
    assert kw["additional_config"] == {"gdn_prefill_backend": "triton"}  # flashinfer's GDN kernel is not there
    assert (kw["max_model_len"], kw["gpu_memory_utilization"], kw["max_num_seqs"]) == (4096, 0.5, 4)
    assert kw["enable_prefix_caching"] is True


def test_engine_args_hf_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    kw = vllm_baseline.engine_args(str(tmp_path), "float16", _engine_ns(), tmp_path / "w", True)
    assert kw["model"] == str(tmp_path) and "load_format" not in kw and kw["dtype"] == "float16"


def test_protocol_rounds(fake_vllm, tmp_path):
    prompts = [[1000 + i] * (20 + i) for i in range(3)]
    rounds = vllm_baseline.throughput_rounds(prompts, [5, 6, 7], 0.0) + \
        vllm_baseline.latency_rounds(prompts[0], 4, 1)
    payload = vllm_baseline.run_vllm({"model": str(tmp_path)}, rounds, tmp_path)
    assert payload["vllm_version"] == "0.0.0+fake" and payload["startup_s"] >= 0
    warm, timed, lat0, lat1 = payload["rounds"]
    assert warm["output_tokens"] == [4, 4] and timed["output_tokens"] == [5, 6, 7] and "ttft_s" not in timed
    assert lat0["output_tokens"] == [4] and 0 < lat1["ttft_s"][0] < lat1["elapsed_s"]
    assert json.loads(fake_vllm.read_text())["kwargs"] == {"model": str(tmp_path)}


def test_result_does_not_wait_for_a_lingering_process(fake_vllm, tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("FAKE_VLLM_LINGER", "6")
    start = time.monotonic()
    payload = vllm_baseline.run_vllm({"model": str(tmp_path)}, [], tmp_path)
    assert payload["rounds"] == [] and time.monotonic() - start < 4


def test_summaries():
    payload = {"vllm_version": "v", "rounds": [
        {"elapsed_s": 9.0, "ttft_s": [9.0], "output_tokens": [5], "cached_tokens": [0]},  # warm-up: ignored
        {"elapsed_s": 1.0, "ttft_s": [0.2], "output_tokens": [5], "cached_tokens": [0]},
        {"elapsed_s": 2.0, "ttft_s": [0.4], "output_tokens": [5], "cached_tokens": [0]},
        {"elapsed_s": 3.0, "ttft_s": [0.6], "output_tokens": [5], "cached_tokens": [0]}]}
    lat = vllm_baseline.summarize_latency(payload, 5)
    assert lat["ttft_s"] == 0.4 and lat["decode_tok_s"] == pytest.approx(4 / 1.6)
    thr = vllm_baseline.summarize_throughput({"vllm_version": "v", "rounds": [payload["rounds"][1]]}, [5], 10)
    assert thr["output_tok_s"] == 5.0 and thr["total_tok_s"] == 15.0 and "warning" not in thr
    thr = vllm_baseline.summarize_throughput({"vllm_version": "v", "rounds": [payload["rounds"][1]]}, [6], 10)
    assert "5 tokens" in thr["warning"]
    pre = vllm_baseline.summarize_prefix({"vllm_version": "v", "rounds": [
        {"elapsed_s": 2.0, "ttft_s": [0.1, 0.3, None, 0.2], "output_tokens": [4] * 4,
         "cached_tokens": [0, 16, 16, 0]}]},
        [[1] * 20] * 4, 4)
    assert pre["ttft_median_s"] == 0.2 and pre["prefill_tokens_computed"] == 48 and pre["output_tok_s"] == 8.0


def test_throughput_cli_with_fake_vllm(fake_vllm, tmp_path):
    out = tmp_path / "r.json"
    rc = main(["bench", "throughput", *TINY, "--num-prompts", "3", "--input-len", "8:12", "--output-len", "3:5",
               "--max-num-batched-tokens", "64", "--baseline", "vllm", "--result-file", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["vllm"]["output_tokens"] == r["lamina"]["output_tokens"] and "warning" not in r["vllm"]
    assert r["ratio_output_tok_s"] == pytest.approx(r["lamina"]["output_tok_s"] / r["vllm"]["output_tok_s"])
    logged = json.loads(fake_vllm.read_text())
    assert logged["kwargs"]["load_format"] == "dummy" and logged["kwargs"]["dtype"] == "float32"
    assert logged["kwargs"]["max_num_batched_tokens"] == 64 and logged["kwargs"]["enable_prefix_caching"] is True
    assert logged["config"]["model_type"] == "llama" and logged["config"]["num_hidden_layers"] == 4


def test_latency_cli_with_fake_vllm(fake_vllm, tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "latency", *TINY, "--input-len", "8", "--output-len", "4", "--repeats", "1",
                 "--baseline", "vllm", "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert 0 < r["vllm"]["ttft_s"] and r["vllm"]["decode_tok_s"] > 0
    assert r["ratio_decode_tok_s"] == pytest.approx(r["lamina"]["decode_tok_s"] / r["vllm"]["decode_tok_s"])
    assert r["ratio_ttft"] == pytest.approx(r["vllm"]["ttft_s"] / r["lamina"]["ttft_s"])


def test_prefix_cli_with_fake_vllm(fake_vllm, tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "prefix", *TINY, "--groups", "2", "--per-group", "2", "--prefix-len", "32",
                 "--question-len", "8", "--output-len", "3", "--baseline", "vllm", "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    v = r["vllm"]
    assert v["prompt_tokens"] == r["cache_on"]["prompt_tokens"] == 4 * 40
    # the fake caches the 32-token prefix for the second request of each group: 2 x 32 tokens saved
    assert v["prefill_tokens_computed"] == 4 * 40 - 2 * 32 and v["engine_args"]["enable_prefix_caching"] is True
    assert r["ratio_speed_cache_on"] == pytest.approx(v["elapsed_s"] / r["cache_on"]["elapsed_s"])
    assert r["ratio_ttft_median_cache_on"] == pytest.approx(v["ttft_median_s"] / r["cache_on"]["ttft_median_s"])


def test_failure_keeps_lamina_figures(fake_vllm, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    out = tmp_path / "r.json"
    rc = main(["bench", "throughput", *TINY, "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
               "--baseline", "vllm", "--result-file", str(out)])
    assert rc == 1
    r = json.loads(out.read_text())
    assert r["lamina"]["output_tokens"] == 4 and "ratio_output_tok_s" not in r
    assert "CUDA out of memory (fake) second line" in r["vllm"]["error"]
    err = [line for line in capsys.readouterr().err.splitlines() if "vLLM baseline failed" in line]
    assert len(err) == 1


def test_save_random_checkpoint_serves_in_lamina(tmp_path, smol_tokenizer, capsys):
    """`lamina bench save-random`: the checkpoint both servers load, with the tokenizer files copied in."""
    from lamina import LLM, SamplingParams

    tok = tmp_path / "tok"
    smol_tokenizer.save_pretrained(tok)
    out = tmp_path / "ckpt"
    assert main(["bench", "save-random", "random:tiny-llama", str(out), "--tokenizer", str(tok),
                 "--dtype", "float32"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["hidden_size"] == 256 and (out / "tokenizer.json").is_file()
    llm = LLM(model=str(out), device="cpu", kv_cache_memory_gb=0.02)
    res = llm.generate([{"prompt_token_ids": [1000, 1001, 1002]}],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(res[0].outputs[0].token_ids) == 3
    # The CLI turns the missing tokenizer into one line and status 2.
    argv = ["bench", "save-random", "tiny-llama", str(tmp_path / "c2"), "--tokenizer", str(tmp_path / "none")]
    assert main(argv) == 2
    assert "no tokenizer files" in capsys.readouterr().err


def test_hf_baseline_builds_the_same_preset():
    """The HF baseline and the vLLM baseline take their config from the same place (bench/checkpoint.py)."""
    import torch

    from lamina.bench.hf_baseline import load_hf

    m = load_hf("random:tiny-llama", torch.float32, torch.device("cpu"), "sdpa")
    assert type(m).__name__ == "LlamaForCausalLM" and m.dtype == torch.float32
    assert (m.config.num_hidden_layers, m.config.hidden_size, m.config.vocab_size) == (4, 256, 32000)
