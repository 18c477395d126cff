"""The real `lamina` console script, run as a new user would: every mistake is one or two lines on stderr and
exit status 2, before any model loads; the help shows every default; bench handles one prompt."""
from __future__ import annotations

import json
import os
import pty
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def lamina_cmd() -> list[str]:
    exe = shutil.which("lamina")
    return [exe] if exe else [sys.executable, "-m", "lamina.cli"]


def run(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*lamina_cmd(), *args], capture_output=True, text=True, timeout=timeout, env=ENV, **kw)


def assert_usage_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and 1 <= len(lines) <= 2, res.stderr
    for n in needles:
        assert n in res.stderr, res.stderr


def write_gguf(path: Path, arch: str = "llama") -> Path:
    """A small valid GGUF file (metadata plus one tensor) made with the gguf package's writer."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_string("general.sampling.temp", "x")  # wrong type: ignored by the sampling defaults
    w.add_float32("general.sampling.top_p", 0.8)
    w.add_int32("general.sampling.top_k", 20)
    w.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def bad_sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    (root / "empty_dir").mkdir()
    (root / "foo").mkdir()
    (root / "foo" / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    good = write_gguf(root / "good.gguf")
    data = good.read_bytes()
    (root / "truncated.gguf").write_bytes(data[: len(data) - 1000])
    (root / "garbage.gguf").write_bytes(b"GGUF" + b"\xff" * 200)
    write_gguf(root / "mamba.gguf", arch="mamba")
    return {p.name: p for p in root.iterdir()}


@pytest.mark.parametrize("args,needles", [
    (["generate", "--model", "/no/such/model", "hi"], ["does not exist"]),
    (["generate", "--dtype", "float8", "hi"], ["--dtype", "float8"]),
    (["generate", "--max-model-len", "0", "hi"], ["--max-model-len"]),
    (["generate", "--max-model-len", "-4", "hi"], ["--max-model-len"]),
    (["generate", "--max-tokens", "0", "hi"], ["--max-tokens"]),
    (["generate", ""], ["empty"]),
    (["serve", "--port", "99999"], ["--port", "99999"]),
    (["bench", "throughput", "--num-prompts", "0"], ["--num-prompts"]),
    (["generate", "--model", "random:no-such-preset", "hi"], ["no-such-preset", "tiny-llama"]),
])
def test_argument_mistakes(args, needles):
    assert_usage_error(run(*args), *needles)


@pytest.mark.parametrize("name,needles", [
    ("empty_dir", ["config.json"]),
    ("foo", ["FooForCausalLM", "LlamaForCausalLM"]),
    ("truncated.gguf", ["truncated.gguf", "truncated"]),
    ("garbage.gguf", ["garbage.gguf", "corrupt"]),
    ("mamba.gguf", ["mamba", "llama"]),
])
def test_model_source_mistakes(bad_sources, name, needles):
    res = run("generate", "--model", str(bad_sources[name]), "hi")
    assert_usage_error(res, *needles)


def test_port_in_use_fails_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        start = time.monotonic()
        res = run("serve", "--port", str(port), "--kv-cache-memory-gb", "0.01")
    assert_usage_error(res, "already in use", str(port))
    assert "serving" not in res.stderr and time.monotonic() - start < 60


def test_log_level_and_verbose():
    quiet = run("--log-level", "warning", "generate", "--model", "/no/such/model", "hi")
    assert_usage_error(quiet, "does not exist")
    assert "INFO" not in quiet.stderr and len(quiet.stderr.strip().splitlines()) == 1
    loud = run("-v", "generate", "--model", "/no/such/model", "hi")
    assert loud.returncode == 2 and "INFO" in loud.stderr


def test_something_is_printed_at_once():
    """The first line comes before the tokenizer and weights are read (they take seconds)."""
    proc = subprocess.Popen([*lamina_cmd(), "generate", "--max-tokens", "1", "hi"], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=ENV)
    try:
        start = time.monotonic()
        first = proc.stderr.readline()
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert "loading" in first and elapsed < 5.0, (first, elapsed)


def test_generate_without_prompt_on_a_terminal_prints_usage():
    master, slave = pty.openpty()
    try:
        res = run("generate", stdin=slave, timeout=60)
    finally:
        os.close(master)
        os.close(slave)
    assert res.returncode == 2 and "usage: lamina generate" in res.stderr and "Traceback" not in res.stderr


def test_help_shows_every_default():
    out = run("generate", "--help").stdout
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--repetition-penalty",
                 "--max-num-seqs", "--block-size", "--seed", "--generation-config", "--dtype"):
        section = out.split(flag, 1)[1].split("\n  --", 1)[0]
        assert "default" in section, (flag, section)
    assert "else 0.7" in run("chat", "--help").stdout  # chat samples unless the model says otherwise
    serve_help = run("serve", "--help").stdout
    assert "--max-request-body-mb" in serve_help and "(default: 4.0)" in serve_help


def test_generation_config_defaults(checkpoints, tmp_path):
    """max_new_tokens from generation_config.json bounds `generate`; an explicit flag wins; `vllm` ignores it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["llama"], ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    common = ["generate", "--model", str(ckpt), "--kv-cache-memory-gb", "0.01", "Hello"]
    assert "[length, 3 tokens]" in run(*common).stdout
    assert "[length, 5 tokens]" in run(*common, "--max-tokens", "5").stdout

    from lamina.generation_config import model_defaults

    assert model_defaults(str(ckpt)) == {"max_tokens": 3, "temperature": 0.0}
    assert model_defaults(str(ckpt), "vllm") == {}
    assert model_defaults("random:tiny-llama", str(ckpt)) == {"max_tokens": 3, "temperature": 0.0}


def test_gguf_sampling_defaults(bad_sources):
    from lamina.generation_config import model_defaults

    # general.sampling.temp has the wrong type and is ignored; the others are read.
    assert model_defaults(str(bad_sources["good.gguf"])) == pytest.approx({"top_p": 0.8, "top_k": 20})


def test_bench_throughput_one_prompt_prints_json_once():
    res = run("bench", "throughput", "--model", "random:tiny-llama", "--num-prompts", "1", "--input-len", "8",
              "--output-len", "4", "--kv-cache-memory-gb", "0.01", "--max-model-len", "64", timeout=300)
    assert res.returncode == 0, res.stderr
    decoder = json.JSONDecoder()
    text = res.stdout[res.stdout.index("{"):]
    result, end = decoder.raw_decode(text)
    assert result["num_prompts"] == 1 and result["lamina"]["output_tokens"] == 4
    assert "{" not in text[end:]  # printed once


def test_ctrl_c_while_loading_and_at_the_chat_prompt(checkpoints):
    import signal

    def start() -> subprocess.Popen:
        return subprocess.Popen([*lamina_cmd(), "chat", "--model", str(checkpoints["llama"]), "--kv-cache-memory-gb",
                                 "0.01"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=ENV)

    loading = start()
    assert "loading" in loading.stderr.readline()
    loading.send_signal(signal.SIGINT)  # while the model loads
    _, err = loading.communicate(timeout=60)
    assert loading.returncode == 130 and "Traceback" not in err, err

    chat = start()
    for line in chat.stderr:
        if "type a message" in line:
            break
    chat.send_signal(signal.SIGINT)  # at the prompt: the program ends cleanly
    _, err = chat.communicate(timeout=60)
    assert chat.returncode == 0 and "Traceback" not in err, err


def test_ctrl_c_during_a_reply_ends_only_the_reply():
    import io

    from lamina import SamplingParams
    from lamina.chat_cli import stream_reply
    from lamina.outputs import CompletionOutput, RequestOutput

    class Engine:  # LLM.stream's contract: outputs after each step; an early end aborts the request
        def __init__(self) -> None:
            self.steps, self.aborted = 0, []

        def stream(self, prompt, params, rid):
            finished = False
            try:
                while not finished:
                    self.steps += 1
                    if self.steps == 3:
                        raise KeyboardInterrupt
                    text = "ab" * self.steps
                    yield RequestOutput(rid, None, [1], [CompletionOutput(0, text, [1] * self.steps)], False)
            finally:
                if not finished:
                    self.aborted.append(rid)

    eng, buf = Engine(), io.StringIO()
    text = stream_reply(eng, "c0", [1, 2], SamplingParams(), out=buf)
    assert text == "abab" and eng.aborted == ["c0"] and buf.getvalue() == "abab [interrupted]\n"
