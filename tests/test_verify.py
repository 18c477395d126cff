"""`lamina verify` through the console script: PASS (exit 0) on a tiny random Gemma 2 checkpoint, FAIL (exit 1)
when lamina's weights differ from the checkpoint's (a perturbed weight injected at load time through a
sitecustomize module: what a loader or family bug looks like from the outside), exit 2 on a bad argument."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gemma_factory import make_gemma_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PERTURB = '''
import torch

import lamina.models.loader as loader

_finalize = loader._finalize


def _perturbed(model):
    model = _finalize(model)
    w = model.model.layers[0].mlp.down_proj.weight.data  # noise, not a scale: a norm follows this projection
    w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.std())
    return model


loader._finalize = _perturbed
'''


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, smol_tokenizer) -> Path:
    return make_gemma_checkpoint(tmp_path_factory.mktemp("verify") / "g2", "gemma2", smol_tokenizer, seed=3)


def run_verify(args: list[str], extra_path: Path | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("lamina") or str(Path(sys.executable).parent / "lamina")
    paths = ([str(extra_path)] if extra_path else []) + [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1"}
    return subprocess.run([exe, "verify", *args], capture_output=True, text=True, env=env, timeout=600)


def test_verify_passes_on_a_faithful_load(ckpt, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe capital of France is\\nParis, and\n")
    r = run_verify([str(ckpt), "--prompts", str(prompts), "--max-tokens", "6"])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert sum("PASS" in line and line.startswith("prompt ") for line in lines) == 2
    assert "greedy agree 6/6" in r.stdout and lines[-1].startswith("PASS: 2/2")


def test_verify_fails_when_lamina_misreads_the_weights(ckpt, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(PERTURB)
    r = run_verify([str(ckpt), "--max-tokens", "4"], extra_path=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("FAIL") and "prompt 1:" in r.stdout


def test_verify_refuses_a_directory_without_a_checkpoint(tmp_path):
    r = run_verify([str(tmp_path)])
    assert r.returncode == 2 and "neither a .gguf file nor a directory with config.json" in r.stderr
