#!/usr/bin/env python3
"""Registers, spills and shared memory of the packed decode attention kernel for sm_90, compiled on a machine
without a GPU (Triton's compiler + the wheel's ptxas -v, as scripts/ptxas_check.py does), for the table's
configurations and the sweep's (heads, block_n, warps, stages) points. --fp8: an FP8 (e4m3) cache with bf16
q, Qwen3-8B heads (G 4), with the PTX instructions that show how its bytes travel: cp.async widths, shared
loads (ld.shared.b8 = a byte-wise dot-operand load), the converts and the MMA's operand type.

    PYTHONPATH=. python scripts/ptxas_decode_attention.py [--fp8] [--words 0|1] [--table]
"""
import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from ptxas_check import C, compile_report  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lamina.kernels import triton_decode_attention as tda  # noqa: E402

PTRS = ["q_ptr", "kc_ptr", "vc_ptr", "o_ptr", "po_ptr", "pm_ptr", "pl_ptr", "bt_ptr", "seq_lens_ptr", "qs_ptr"]
INTS = ["window", "num_splits", "num_q_heads", "num_kv_heads", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
        "stride_bt", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt", "stride_vh"]
# the PREP arguments (decode_prep's fold), off here: constexprs so the optional pointers compile as None
PREP_OFF = dict(k_ptr=None, v_ptr=None, pos_ptr=None, slot_ptr=None, cs_ptr=None, qw_ptr=None, kw_ptr=None,
                stride_nkt=0, stride_nkh=0, stride_nvt=0, stride_nvh=0, stride_cs=0, eps=0.0, norm_off=0.0,
                PREP=False, ROT=0, HAS_NORM=False)
PATTERNS = r"(ld\.shared[.a-z0-9]*|ldmatrix[.a-z0-9]*|mma\.sync[.a-z0-9]*|cvt\.rn\.f16x2\.e4m3x2|cvt\.bf16\.f16)"


def signature(cache: str) -> tuple[dict, tuple]:
    sig = dict(zip(PTRS, ["*bf16", cache, cache, "*bf16", "*fp32", "*fp32", "*fp32", "*i32", "*i32", "*i32"]))
    sig.update(scale_log2="fp32", cap_log2="fp32")
    sig.update({n: "i32" for n in INTS})
    for n in ["G", "HEADS", "M_PAD", "BLOCK_N", "D", "BLOCK_D", "DV", "BLOCK_DV", "PAGE", "SLIDING", "DIRECT",
              "DOT_PREC", "SOFTCAP", "IDS_AHEAD", *PREP_OFF, "V_WORDS"]:
        sig[n] = C
    # pointers and the 16-divisible ints (q heads 16, strides); window, num_splits, stride_bt not specialized
    aligned = tuple(range(10)) + tuple(12 + INTS.index(n) for n in INTS
                                       if n not in ("window", "num_splits", "stride_bt", "num_kv_heads"))
    return sig, aligned


def ptx_counts(sig, consts, aligned, warps, stages) -> str:
    kernel = triton.compile(ASTSource(fn=tda._decode_packed_kernel, signature=sig, constexprs=consts,
                                      attrs={(i,): [["tt.divisibility", 16]] for i in aligned}),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptx = kernel.asm["ptx"]
    counts = collections.Counter(re.findall(PATTERNS, ptx))
    counts.update("cp.async " + w for w in re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], "
                                                      r"(0x[0-9a-f]+)", ptx))
    short = {k.replace("sync.aligned.", "").replace(".shared", ""): v for k, v in sorted(counts.items())}
    return f"smem {kernel.metadata.shared // 1024}K  " + " ".join(f"{k}:{v}" for k, v in short.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp8", action="store_true", help="an FP8 cache (else bf16), Qwen3-8B heads")
    ap.add_argument("--words", type=int, default=1, help="FP8: V read as words (the compiled default)")
    ap.add_argument("--table", action="store_true", help="only the table's configurations")
    args = ap.parse_args()
    sig, aligned = signature("*fp8e4nv" if args.fp8 else "*bf16")
    g = 4 if args.fp8 else 2
    key = "8" if args.fp8 else "16"
    points = {(c.heads, c.block_n, c.warps, c.stages, c.ids_ahead) for k, c in tda.DECODE_TABLE.items()
              if k[:2] == (key, 128)}
    if not args.table:
        tokens = [(1, 64), (1, 128), (1, 256), (2, 64), (4, 32)] if args.fp8 else \
            [(1, 64), (1, 128), (2, 32), (2, 64), (4, 16), (4, 32), (8, 16), (8, 32)]
        points |= {(h, n, w, s, a) for h, n in tokens for w, s in [(4, 2), (4, 3), (8, 2), (8, 3)]
                   for a in (False, True)}
    for h, n, w, s, ahead in sorted(points):
        for direct in (True, False):
            consts = dict(PREP_OFF, G=g, HEADS=h, M_PAD=max(16, g * h), BLOCK_N=n, D=128, BLOCK_D=128, DV=128,
                          BLOCK_DV=128, PAGE=16, SLIDING=False, DIRECT=direct, DOT_PREC="tf32", SOFTCAP=False,
                          IDS_AHEAD=ahead, V_WORDS=2 * bool(args.fp8 and args.words))
            name = f"decode h{h} n{n} w{w} s{s} ahead={int(ahead)} {'direct' if direct else 'split '}"
            try:
                compile_report(tda._decode_packed_kernel, sig, consts, aligned, w, s, name)
                print("    " + ptx_counts(sig, consts, aligned, w, s), flush=True)
            except Exception as e:  # out of shared memory etc.
                print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")


if __name__ == "__main__":
    main()
