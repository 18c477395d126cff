#!/usr/bin/env python3
"""Compiles this round's decode kernels for sm_90 on a machine without a GPU (Triton's compiler + the wheel's
ptxas -v) and prints registers, spills and whether the PDL variants carry griddepcontrol / L2 prefetches.
Pointers and 16-divisible integers get tt.divisibility=16 as the runtime gives them (without it the counts
mean nothing).

    PYTHONPATH=. python scripts/ptxas_check.py
"""
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lamina.kernels import triton_gdn_conv_decode as gc  # noqa: E402
from lamina.kernels import triton_gemv as g  # noqa: E402
from lamina.kernels import triton_moe_decode as md  # noqa: E402
from lamina.kernels import triton_norm_gated_gemv as ng  # noqa: E402

D16 = [["tt.divisibility", 16]]
C = "constexpr"


def compile_report(fn, sig: dict, consts: dict, aligned: tuple, warps: int, stages: int, name: str) -> None:
    attrs = {(i,): D16 for i in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(tmp, "k.o"))],
                             capture_output=True, text=True)
    info = " ".join(line.split(":", 1)[-1].strip() for line in res.stderr.splitlines()
                    if "registers" in line or "spill" in line)
    flags = " ".join(f for f, key in (("prefetch", "prefetch.global.L2"), ("griddep", "griddepcontrol")) if key in ptx)
    print(f"{name:48s} {info} {flags}", flush=True)


def main() -> None:
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "r_ptr": "*bf16", "s_ptr": "*bf16", "nw_ptr": "*bf16", "eps": "fp32", "nw_off": "fp32",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_rm": "i32", "stride_sm": "i32",
           "stride_wn": "i32", "stride_ym": "i32", "k_per_split": "i32", "BLOCK_M": C, "BLOCK_N": C, "BLOCK_K": C,
           "SPLIT_K": C, "USE_DOT": C, "HAS_BIAS": C, "EVEN_K": C, "DOT_PREC": C, "PDL": C, "PREFETCH_K": C,
           "LINE": C, "PRO": C}
    aligned = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18, 19)  # pointers and 16-divisible ints
    tiles = [(16, 32, 256, 1, True, 4, 4), (16, 32, 256, 2, True, 4, 4), (1, 4, 1024, 1, False, 4, 3),
             (16, 64, 256, 1, True, 8, 3), (16, 32, 512, 1, True, 4, 3)]
    # PRO: 0 plain, 2 add + RMSNorm, 3 SiLU-and-mul (the prologues of dense_decode_path); PDL only plain
    for pdl, pro in ((False, 0), (True, 0), (False, 2), (False, 3)):
        for bm, bn, bk, sk, dot, w, st in tiles:
            consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, USE_DOT=dot, HAS_BIAS=False, EVEN_K=True,
                          DOT_PREC="tf32", PDL=pdl, PREFETCH_K=1024 if pdl else 0, LINE=64, PRO=pro)
            compile_report(g._gemv_kernel, sig, consts, aligned, w, st,
                           f"gemv pdl={pdl} pro={pro} m{bm} n{bn} k{bk} s{sk} {'dot' if dot else 'fma'} w{w} st{st}")
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*fp32", "logit_ptr": "*fp32", "cnt_ptr": "*i32",
           "wout_ptr": "*bf16", "iout_ptr": "*i64", "T": "i32", "E": "i32", "H": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "TOP_K": C, "SHARED": C, "BLOCK_T": C, "BLOCK_E": C, "BLOCK_K": C, "BLOCK_ALL": C,
           "BLOCK_SLOT": C, "SIGMOID": C, "HAS_BIAS": C, "RENORM": C}
    for bt in (1, 16):  # the Qwen3-Next router: 512 experts + the shared gate, top 10, H 2048
        bk = min(2048, max(64, 8192 // (bt * 4)))
        consts = dict(TOP_K=10, SHARED=1, BLOCK_T=bt, BLOCK_E=4, BLOCK_K=bk, BLOCK_ALL=512, BLOCK_SLOT=16,
                      SIGMOID=False, HAS_BIAS=False, RENORM=True)
        compile_report(md._route_kernel, sig, consts, (0, 1, 2, 3, 4, 5, 6, 9, 10, 11), 8 if bt > 1 else 4, 3,
                       f"route T{bt} k{bk}")
    sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64", "wts_ptr": "*bf16",
           "S": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32",
           "stride_om": "i32", "BLOCK_S": C, "BLOCK_N": C, "BLOCK_K": C}
    for bn, bk, w in [(4, 128, 4), (4, 256, 4), (8, 128, 4), (2, 512, 4), (4, 512, 8)]:
        compile_report(md._down_sum_kernel, sig, dict(BLOCK_S=16, BLOCK_N=bn, BLOCK_K=bk),
                       (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11), w, 3, f"down_sum n{bn} k{bk} w{w}")
    sig = {"x_ptr": "*bf16", "z_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32",
           "N": "i32", "K": "i32", "stride_xm": "i32", "stride_zm": "i32", "stride_wn": "i32", "stride_ym": "i32",
           "eps": "fp32", "D": C, "HEADS": C, "BLOCK_M": C, "BLOCK_N": C, "USE_DOT": C, "DOT_PREC": C}
    for bm, bn, hp, dot in [(1, 8, 4, False), (4, 8, 4, False), (16, 16, 2, True)]:
        consts = dict(D=128, HEADS=hp, BLOCK_M=bm, BLOCK_N=bn, USE_DOT=dot, DOT_PREC="tf32")
        compile_report(ng._gated_norm_gemv_kernel, sig, consts, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11), 4, 3,
                       f"gated_norm_gemv m{bm} n{bn} heads{hp} {'dot' if dot else 'fma'}")
    names = ["x_ptr", "cw_ptr", "cb_ptr", "conv_ptr", "a_ptr", "b_ptr", "alog_ptr", "dtb_ptr", "state_ptr", "slot_ptr",
             "init_ptr", "cnt_ptr", "out_ptr"]
    types = ["*bf16", "*bf16", "*bf16", "*bf16", "*bf16", "*bf16", "*fp32", "*fp32", "*fp32", "*i64", "*u8", "*i32",
             "*bf16"]
    sig = dict(zip(names, types))
    sig.update({n: "i32" for n in ("num_k_heads", "stride_x", "stride_cs", "stride_cc", "stride_wc", "stride_ab",
                                   "stride_bb", "stride_ss", "stride_sh", "stride_sk", "stride_ob", "stride_oh")})
    sig["scale"] = "fp32"
    sig.update({n: C for n in ("GROUP", "DK", "DV", "BLOCK_K", "BLOCK_V", "KW", "BLOCK_W", "HAS_CB", "HAS_STATE",
                               "HAS_INIT", "L2NORM")})
    consts = dict(GROUP=2, DK=128, DV=128, BLOCK_K=128, BLOCK_V=32, KW=4, BLOCK_W=4, HAS_CB=False, HAS_STATE=True,
                  HAS_INIT=True, L2NORM=True)
    compile_report(gc._gdn_conv_decode_kernel, sig, consts, tuple(range(13)) + (15, 16, 18, 19, 20, 21, 22, 23, 24),
                   4, 3, "gdn_conv_decode Qwen3-Next 128x32")


if __name__ == "__main__":
    main()
