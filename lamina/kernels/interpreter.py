"""Running the Triton kernels through Triton's interpreter (CPU-only machines: CI and the GPU scripts'
--interpret smoke runs). Compiled kernels never need this."""
from __future__ import annotations


def patch_triton_interpreter() -> None:
    """Lets the interpreter's scalars act as indices. Triton 3.6/3.7's interpreter keeps a loaded scalar as a
    1-element array, and numpy >= 2.4 refuses int() on those, which breaks range() over loaded bounds.
    Idempotent; call it once triton is importable with TRITON_INTERPRET=1."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_lamina_patched", False):
        return
    orig = interp._patch_lang_tensor

    def patch(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch
    interp._lamina_patched = True
