"""FP8 linears through fp8_linear's defaults (the GEMV at M <= 16, past it block_gemm(): torch's blockwise
_scaled_mm on Hopper, or the fused quantization + row-wise _scaled_mm) against the dequantized reference,
on fresh random inputs. CUDA only. Past M = 16 the paths quantize the activations to e4m3 too (W8A8), and e4m3's
3 mantissa bits alone put ~2.6e-2 of relative error on the product (the first H200 run, 2026-12-02 evening,
measured 2.6e-2 on every M > 16 row), so those rows are held to the reference that quantizes the activations
the same way, and their distance from the weight-only reference is printed beside it.
Usage: python scripts/fp8_default_check.py   (~15 s on an H200; exits 1 past a relative error of 2e-2)"""
import sys

import torch

from lamina.kernels import fp8
from lamina.kernels.fp8 import (
    MAX_GEMV_M,
    dequantize,
    fp8_linear,
    fp8_linear_ref,
    quantize_blocks,
    quantize_rows,
    quantize_tokens,
)


def w8a8_ref(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The product with the activations rounded as the M > 16 paths round them: per token, 1 x bk groups."""
    if block:  # per 1 x bk group: the activation scales are a (1, bk) block grid
        xd = dequantize(*quantize_tokens(x, block[1]), (1, block[1]), torch.float64)
    else:  # per token: one scale per row
        xq, xs = quantize_tokens(x)
        xd = dequantize(xq, xs[:, 0], None, torch.float64)
    return xd @ dequantize(q, s, block, torch.float64).t()


def main() -> int:
    print("block gemm:", fp8.block_gemm(torch.device("cuda")))
    torch.manual_seed(0)
    worst = 0.0
    for n, k in ((6144, 4096), (4096, 12288)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for block in ((128, 128), None):
            q, s = quantize_blocks(w, block) if block else quantize_rows(w)
            for m in (1, 2, 3, 16, 17, 64, 300):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                y, ref = fp8_linear(x, q, s, block).double(), fp8_linear_ref(x, q, s, block).double()
                wo = ((y - ref).norm() / ref.norm()).item()
                if m > MAX_GEMV_M:
                    ref = w8a8_ref(x, q, s, block)
                err = ((y - ref).norm() / ref.norm()).item()
                worst = max(worst, err)
                kind = "w8a8" if m > MAX_GEMV_M else "weight-only"
                print(f"N {n} K {k} {'block 128' if block else 'rows'} M {m}: rel err {err:.2e} vs the {kind} "
                      f"reference ({wo:.2e} vs weight-only)")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
