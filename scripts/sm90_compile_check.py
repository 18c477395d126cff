#!/usr/bin/env python3
"""Compiles kernel variants for sm_90 on a machine without a GPU (Triton's compiler, LLVM and the wheel's ptxas),
to catch what Triton's interpreter cannot: the interpreter runs the kernel as Python, so type errors of the
compiler's frontend (a loop-carried variable changing type, say) pass every CPU test and fail on the GPU.
tests/kernels/ run it in a subprocess (their own process has the interpreter's kernels). Exit status 1 names
the variants that did not compile.

    PYTHONPATH=. python scripts/sm90_compile_check.py [group ...]      (default: every group)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def compile_sm90(fn, sig: dict, consts: dict, warps: int = 4, stages: int = 2):
    sig = {**sig, **dict.fromkeys(consts, "constexpr")}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def _decode_sig(cache: str) -> dict:
    sig = dict.fromkeys(["q_ptr", "o_ptr"], "*bf16")
    sig.update(kc_ptr=cache, vc_ptr=cache)

    sig.update(dict.fromkeys(["po_ptr", "pm_ptr", "pl_ptr"], "*fp32"))
    sig.update(dict.fromkeys(["bt_ptr", "seq_lens_ptr", "qs_ptr"], "*i32"))
    sig.update(scale_log2="fp32", cap_log2="fp32")
    sig.update(dict.fromkeys(["window", "num_splits", "num_q_heads", "num_kv_heads", "stride_qt", "stride_qh",
                              "stride_ot", "stride_oh", "stride_bt", "stride_kb", "stride_kt", "stride_kh",
                              "stride_vb", "stride_vt", "stride_vh"], "i32"))
    sig.update(k_ptr="*bf16", v_ptr="*bf16", pos_ptr="*i64", slot_ptr="*i64", cs_ptr="*fp32", qw_ptr="*bf16",
               kw_ptr="*bf16", eps="fp32", norm_off="fp32")
    sig.update(dict.fromkeys(["stride_nkt", "stride_nkh", "stride_nvt", "stride_nvh", "stride_cs"], "i32"))
    return sig


def decode_prep():
    """The packed decode attention kernel with the attention prep folded in (PREP), split and direct, with and
    without the block ids loaded a step ahead."""
    from lamina.kernels import triton_decode_attention as tda

    sig = _decode_sig("*bf16")
    for ahead in (False, True):
        for direct in (False, True):
            consts = dict(G=4, HEADS=1, M_PAD=16, BLOCK_N=64, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128, PAGE=16,
                          SLIDING=False, DIRECT=direct, DOT_PREC="tf32", SOFTCAP=False, IDS_AHEAD=ahead, PREP=True,
                          ROT=128, HAS_NORM=True, V_WORDS=0)
            yield f"decode_prep ahead={ahead} direct={direct}", tda._decode_packed_kernel, sig, consts


def decode_fp8():
    """Decode attention over an FP8 cache: V read plain, as words split by shifts, as words through the inline
    PTX converts (V_WORDS 0/1/2), with the FP8 table's 128-token steps; with the prep folded in too."""
    from lamina.kernels import triton_decode_attention as tda

    sig = _decode_sig("*fp8e4nv")
    for words in (0, 1, 2):
        for prep in (False, True):
            consts = dict(G=4, HEADS=1, M_PAD=16, BLOCK_N=128, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128, PAGE=16,
                          SLIDING=False, DIRECT=False, DOT_PREC="tf32", SOFTCAP=False, IDS_AHEAD=True, PREP=prep,
                          ROT=128 if prep else 0, HAS_NORM=prep, V_WORDS=words)
            yield f"decode_fp8 v_words={words} prep={prep}", tda._decode_packed_kernel, sig, consts


def wq_kn():
    """The repacked 4-bit decode GEMVs: one row per program, and ROWS rows sharing each word (split-K on)."""
    from lamina.kernels import triton_wq_gemv_kn as kn

    sig = dict(x_ptr="*bf16", q_ptr="*i32", s_ptr="*bf16", o_ptr="*bf16", y_ptr="*bf16", ws_ptr="*fp32",
               lock_ptr="*i32", M="i32", N="i32", KW="i32", stride_xm="i32", stride_qk="i32", stride_sg="i32",
               stride_ym="i32", SPLIT_K="i32")
    for rows, block_n in ((4, 128), (16, 64)):
        consts = dict(GROUP=128, ROWS=rows, BLOCK_N=block_n, BLOCK_KW=8, STEPS=4, SPLIT_P2=4, ASM=True)
        yield f"wq_kn rows={rows} n{block_n}", kn._kn_rows_kernel, sig, consts


GROUPS = {"decode_prep": decode_prep, "decode_fp8": decode_fp8, "wq_kn": wq_kn}


def main(names: list[str]) -> int:
    failed = []
    for group in names or list(GROUPS):
        for label, fn, sig, consts in GROUPS[group]():
            try:
                kernel = compile_sm90(fn, sig, consts)
                print(f"ok   {label}: smem {kernel.metadata.shared} B")
            except Exception as e:  # noqa: BLE001  (any compiler error is the finding)
                failed.append(label)
                print(f"FAIL {label}: {type(e).__name__}: {str(e)[-600:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
