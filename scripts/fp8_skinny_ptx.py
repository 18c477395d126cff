#!/usr/bin/env python3
"""Compiles the skinny FP8 GEMM (triton_fp8_skinny.py) for sm_90 on a machine without a GPU and prints, per
variant and tile: ptxas registers/spills, the PTX conversions (tc16 must upcast with the packed
cvt.rn.f16x2.e4m3x2 and no cvt.bf16.f16), the wgmma shape, and SASS counts of the conversion ops
(F2FP packed, F2F scalar) from the bundled cuobjdump.

    PYTHONPATH=. python scripts/fp8_skinny_ptx.py
"""
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
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lamina.kernels import triton_fp8_skinny as sk  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
C = "constexpr"
SIG = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16",
       "part_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
       "stride_wn": "i32", "stride_sn": "i32", "stride_sk": "i32", "stride_ym": "i32", "group_n": "i32",
       "k_per_split": "i32", "GROUP_K": C, "ROW_SCALE": C, "HAS_BIAS": C, "EVEN_K": C, "DOT_F32": C, "F16": C,
       "BLOCK_M": C, "BLOCK_N": C, "BLOCK_K": C, "SPLIT_K": C}
ALIGNED = (0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 14, 16)  # pointers and the 16-divisible ints, as launches give them


def report(f16: bool, rows: bool, bn: int, bk: int, split: int, warps: int, stages: int) -> None:
    consts = dict(GROUP_K=1 if rows else 128, ROW_SCALE=rows, HAS_BIAS=False, EVEN_K=True, DOT_F32=False, F16=f16,
                  BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split)
    kern = triton.compile(ASTSource(fn=sk._fp8_skinny_kernel, signature=SIG, constexprs=consts,
                                    attrs={(i,): [["tt.divisibility", 16]] for i in ALIGNED}),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = kern.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.ptx").write_text(ptx)
        res = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(Path(tmp, "k.ptx")), "-o",
                              str(Path(tmp, "k.o"))], capture_output=True, text=True)
        Path(tmp, "k.cubin").write_bytes(kern.asm["cubin"])
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", str(Path(tmp, "k.cubin"))], capture_output=True,
                              text=True).stdout
    info = " ".join(line.split(":", 1)[-1].strip() for line in res.stderr.splitlines()
                    if "registers" in line or "spill" in line)
    cvt = Counter(c for c in re.findall(r"cvt\.[a-z0-9.]+", ptx) if "f16" in c or "e4m3" in c)
    mma = sorted(set(re.findall(r"wgmma\.mma_async[a-z0-9._]*|mma\.sync[a-z0-9._]*", ptx)))
    ops = Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\d+\s+)?([A-Z0-9]+)", sass, re.M))
    name = f"{'tc16' if f16 else 'tc'} {'rows' if rows else 'block'} n{bn} k{bk} s{split} w{warps} st{stages}"
    print(f"{name:36s} {info}\n    ptx {dict(cvt)} {mma}\n    sass F2FP {ops['F2FP']} F2F {ops['F2F']} "
          f"HGMMA {ops['HGMMA']} LDS {ops['LDS']} PRMT {ops['PRMT']}", flush=True)


def main() -> None:
    for f16 in (True, False):
        for rows in (False, True):
            report(f16, rows, 64, 128, 4, 4, 4)
    for f16 in (True, False):
        report(f16, False, 128, 128, 2, 8, 4)
        report(f16, True, 64, 256, 2, 4, 3)


if __name__ == "__main__":
    main()
