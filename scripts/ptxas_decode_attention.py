#!/usr/bin/env python3
"""Registers, spills and shared memory of the packed decode attention kernel for sm_90, compiled on a machine
without a GPU (Triton's compiler + the wheel's ptxas -v, as scripts/ptxas_check.py does), for the table's
configurations and the sweep's (heads, block_n, warps, stages) points, Qwen3-0.6B heads (G 2, D 128, bf16).

    PYTHONPATH=. python scripts/ptxas_decode_attention.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from ptxas_check import C, compile_report  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lamina.kernels import triton_decode_attention as tda  # noqa: E402


def shared_bytes(sig, consts, aligned, warps, stages) -> int:
    kernel = triton.compile(ASTSource(fn=tda._decode_packed_kernel, signature=sig, constexprs=consts,
                                      attrs={(i,): [["tt.divisibility", 16]] for i in aligned}),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    return kernel.metadata.shared


def main() -> None:
    ptrs = ["q_ptr", "kc_ptr", "vc_ptr", "o_ptr", "po_ptr", "pm_ptr", "pl_ptr", "bt_ptr", "seq_lens_ptr", "qs_ptr"]
    types = ["*bf16", "*bf16", "*bf16", "*bf16", "*fp32", "*fp32", "*fp32", "*i32", "*i32", "*i32"]
    sig = dict(zip(ptrs, types))
    sig.update(scale_log2="fp32", cap_log2="fp32")
    ints = ["window", "num_splits", "num_q_heads", "num_kv_heads", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
            "stride_bt", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt", "stride_vh"]
    sig.update({n: "i32" for n in ints})
    names = ["G", "HEADS", "M_PAD", "BLOCK_N", "D", "BLOCK_D", "DV", "BLOCK_DV", "PAGE", "SLIDING", "DIRECT",
             "DOT_PREC", "SOFTCAP", "IDS_AHEAD"]
    sig.update({n: C for n in names})
    # pointers and the 16-divisible ints (q heads 16, strides); window, num_splits, stride_bt not specialized
    aligned = tuple(range(10)) + tuple(12 + ints.index(n) for n in ints
                                       if n not in ("window", "num_splits", "stride_bt", "num_kv_heads"))
    points = sorted({(c.heads, c.block_n, c.warps, c.stages, c.ids_ahead) for k, c in tda.DECODE_TABLE.items()
                     if k[1] == 128}
                    | {(h, n, w, s, a) for h, n in [(1, 64), (1, 128), (2, 32), (2, 64), (4, 16), (4, 32), (8, 16),
                                                    (8, 32)] for w, s in [(4, 2), (4, 3), (8, 2), (8, 3)]
                       for a in (False, True)})
    for h, n, w, s, ahead in points:
        for direct in (True, False):
            consts = dict(G=2, HEADS=h, M_PAD=max(16, 2 * h), BLOCK_N=n, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128,
                          PAGE=16, SLIDING=False, DIRECT=direct, DOT_PREC="tf32", SOFTCAP=False, IDS_AHEAD=ahead)
            try:
                smem = shared_bytes(sig, consts, aligned, w, s)
                compile_report(tda._decode_packed_kernel, sig, consts, aligned, w, s,
                               f"decode h{h} n{n} w{w} s{s} ahead={int(ahead)} {'direct' if direct else 'split '} "
                               f"smem {smem // 1024}K")
            except Exception as e:  # out of shared memory etc.
                msg = str(e).splitlines()[0][:80]
                print(f"decode h{h} n{n} w{w} s{s} ahead={int(ahead)}: {type(e).__name__}: {msg}")


if __name__ == "__main__":
    main()
