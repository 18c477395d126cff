"""The Triton kernel tests run on a CUDA machine, or on a CPU through Triton's interpreter (tiny shapes), which
this conftest switches on when there is no GPU and triton is installed (the test extra installs it), so CI
checks every kernel against its torch reference too."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

_SET_INTERPRET = (not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
                  and "TRITON_INTERPRET" not in os.environ)
if _SET_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # for kernel_helpers.INTERPRET; kernel modules are imported lazily
    import triton.language  # noqa: F401  (triton decorates its own library functions for the interpreter now)

from kernel_helpers import CUDA, INTERPRET  # noqa: E402

if _SET_INTERPRET:
    # Set only while a kernel test runs (the fixture below): left in os.environ it reached every subprocess
    # the rest of the session starts, and the server tests' engine misbehaves under it
    # (test_disconnect_mid_stream_frees_everything failed whenever a kernel test ran first).
    del os.environ["TRITON_INTERPRET"]


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA (or TRITON_INTERPRET=1)")
    for item in items:
        if "tests/kernels/" in str(item.fspath).replace("\\", "/") and not CUDA and not INTERPRET:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    pytest.importorskip("triton")
    if _SET_INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # before the test imports a kernel module
    if INTERPRET:
        from lamina.kernels.interpreter import patch_triton_interpreter

        patch_triton_interpreter()
