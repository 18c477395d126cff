#!/usr/bin/env python3
"""Compiles the weight-quantized matmul kernels (kernels/triton_wq_matmul.py) for sm_90 on a machine without
a GPU and counts what decides their speed in the SASS: global load widths (LDG.E.128 = 16-byte vectors,
LDGSTS = cp.async), integer-to-float converts (I2F, quarter rate on Hopper), registers, stack (spills),
shared memory. Uses triton's bundled ptxas / cuobjdump.

    python scripts/wq_sass_counts.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import lamina.kernels.triton_wq_matmul as W  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def counts(cfg: W.WqConfig, bits: int, group: int, dtype: str = "bf16") -> dict:
    gemv = cfg.kernel.startswith("gemv")
    fn = W._wq_gemv_kernel if gemv else W._wq_dot_kernel
    ptrs = {"x_ptr": f"*{dtype}", "q_ptr": "*u8" if bits == 4 else "*i8", "s_ptr": "*fp16", "o_ptr": "*fp16",
            "y_ptr": f"*{dtype}"}
    block_k = W.fit_block_k(cfg.block_k, group, 4096, 16 if gemv else 32)
    consts = dict(GROUP=group, BITS=bits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                  SPLIT_K=cfg.split_k, EVEN_K=True, MAGIC=cfg.kernel != "gemv_cvt",
                  PREFETCH=cfg.kernel == "gemv_pf", JOIN=cfg.kernel == "dot_join", IEEE=False)
    names = list(fn.arg_names)
    sig = {a: ptrs.get(a, "constexpr" if a in consts else "i32") for a in names}
    used = {a: consts[a] for a in names if a in consts}
    # the launcher's divisibility-16 specialization of pointers, K and the row strides (all real shapes)
    hints = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if a in ptrs or a in ("K", "stride_xm", "stride_qn", "stride_ym")}
    kern = triton.compile(ASTSource(fn, sig, used, hints), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kern.asm["cubin"])
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([f"{BIN}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True,
                         text=True).stdout
    os.unlink(f.name)
    return {"loads": dict(Counter(re.findall(r"(?:LDGSTS|LDG)[.\w]*", sass))),
            "I2F": len(re.findall(r"\bI2F", sass)), "regs": int(re.search(r"REG:(\d+)", res).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", res).group(1)), "shared": kern.metadata.shared}


def main() -> None:
    for bits, group in ((4, 128), (4, 32), (8, 32)):
        for m, n, k in ((1, 4096, 4096), (1, 24576, 4096), (16, 4096, 4096), (2048, 4096, 4096)):
            cfg = W.heuristic_config(m, n, k, group, 132, bits)
            print(f"int{bits} g{group} M={m} N={n}: {cfg}\n    {counts(cfg, bits, group)}")
    print("A/B variants (int4 g128):")
    for cfg in (W.WqConfig("gemv_cvt", 1, 8, 1024, num_stages=1), W.WqConfig("dot", 128, 128, 64, num_warps=8)):
        print(f"  {cfg}\n    {counts(cfg, 4, 128)}")


if __name__ == "__main__":
    main()
