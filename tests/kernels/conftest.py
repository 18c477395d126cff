"""The Triton kernel tests run on a CUDA machine, or on a CPU under TRITON_INTERPRET=1 (slow, tiny shapes)."""
from __future__ import annotations

import pytest

from kernel_helpers import CUDA, INTERPRET


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
