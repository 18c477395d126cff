"""Kernel variants compiled for sm_90 on this machine (scripts/sm90_compile_check.py): the interpreter runs a
kernel as Python, not through Triton's compiler, so compile-only failures pass every interpreter test. One
did: the folded attention prep's `slot` changed type inside the key loop, and every sm_90 compile failed.
Compiling needs no GPU (Triton's frontend, LLVM and the wheel's ptxas); it runs in a subprocess because this
process's kernels are the interpreter's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("group,variants", [("decode_prep", 4), ("decode_fp8", 6), ("wq_kn", 2)])
def test_kernels_compile_for_sm90(group, variants):
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "sm90_compile_check.py"), group], cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("ok ") == variants  # every variant of the group compiled
