"""The Triton kernel tests run on a CUDA machine, or on a CPU through Triton's interpreter (tiny shapes), which
this conftest switches on when there is no GPU and triton is installed (the test extra installs it), so CI
checks every kernel against its torch reference too."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (tests import lazily)

from kernel_helpers import CUDA, INTERPRET  # noqa: E402


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA (or TRITON_INTERPRET=1)")
    for item in items:
        if "tests/kernels/" in str(item.fspath).replace("\\", "/") and not CUDA and not INTERPRET:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _triton():
    pytest.importorskip("triton")
    if INTERPRET:
        import triton.runtime.interpreter as interp

        if not getattr(interp, "_lamina_patched", False):
            orig = interp._patch_lang_tensor

            def patch(tensor, scope):  # numpy >= 2.4 refuses int() on the interpreter's 1-element scalars
                orig(tensor, scope)
                scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

            interp._patch_lang_tensor = patch
            interp._lamina_patched = True
