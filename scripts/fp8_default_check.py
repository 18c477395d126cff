"""FP8 linears through fp8_linear's defaults (the GEMV at M <= 16, past it block_gemm(): torch's blockwise
_scaled_mm on Hopper, or the fused quantization + row-wise _scaled_mm) against the dequantized reference,
on fresh random inputs. CUDA only; written after the 2026-12-02 sweeps set those defaults, not yet run.
Usage: python scripts/fp8_default_check.py   (~15 s on an H200; exits 1 past a relative error of 2e-2)"""
import sys

import torch

from lamina.kernels import fp8
from lamina.kernels.fp8 import fp8_linear, fp8_linear_ref, quantize_blocks, quantize_rows


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
                err = ((y - ref).norm() / ref.norm()).item()
                worst = max(worst, err)
                print(f"N {n} K {k} {'block 128' if block else 'rows'} M {m}: rel err {err:.2e}")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
