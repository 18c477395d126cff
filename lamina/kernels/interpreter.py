"""Running the Triton kernels through Triton's interpreter (CPU-only machines: CI and the GPU scripts'
--interpret smoke runs). Compiled kernels never need this."""
from __future__ import annotations


def patch_triton_interpreter() -> None:
    """Lets the interpreter's scalars act as indices. Triton 3.6/3.7's interpreter keeps a loaded scalar as a
    1-element array, and numpy >= 2.4 refuses int() on those, which breaks range() over loaded bounds.
    Also casts float -> fp8e4nv through torch: the interpreter's own rounding drops the carry into the
    exponent (125.1 -> 64 instead of 128; 1-2% of a random tensor's codes). Idempotent; call it once triton
    is importable with TRITON_INTERPRET=1."""
    import triton.runtime.interpreter as interp

    if getattr(interp, "_lamina_patched", False):
        return
    orig = interp._patch_lang_tensor

    def patch(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch
    _patch_fp8_rounding(interp)
    interp._lamina_patched = True


def _patch_fp8_rounding(interp) -> None:
    import numpy as np
    import torch
    import triton.language as tl

    builder = interp.InterpreterBuilder
    orig = builder.create_fp_to_fp

    def fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in (tl.float32, tl.float16):
            return orig(self, src, dst_type, rounding_mode)
        wide = torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float32))
        data = wide.to(torch.float8_e4m3fn).view(torch.uint8).numpy()  # round to nearest even, like sm90's cvt
        return interp.TensorHandle(data, dst_type.scalar)

    builder.create_fp_to_fp = fp_to_fp
