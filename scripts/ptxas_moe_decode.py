#!/usr/bin/env python3
"""Registers and spills of the MoE decode expert kernels (the streaming ones and the one-shot kernels they are
swept against) and the route kernel at 1-4 warps, compiled for sm_90 on a machine without a GPU (as
scripts/ptxas_check.py; the PDL variants must carry griddepcontrol).

    PYTHONPATH=. python scripts/ptxas_moe_decode.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ptxas_check import C, compile_report  # noqa: E402

from lamina.kernels import triton_moe as tm  # noqa: E402
from lamina.kernels import triton_moe_decode as md  # noqa: E402
from lamina.kernels import triton_moe_stream as ms  # noqa: E402


def main() -> None:
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64", "S": "i32", "N": "i32",
           "K": "i32", "stride_xm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_om": "i32",
           "n_tiles": "i32", "BLOCK_N": C, "BLOCK_K": C, "PDL": C}
    for bn, w, pdl in [(2, 8, False), (2, 8, True), (4, 8, False), (2, 4, False), (1, 4, False)]:
        compile_report(ms._gate_up_stream_kernel, sig, dict(BLOCK_N=bn, BLOCK_K=2048, PDL=pdl),
                       (0, 1, 2, 3, 5, 6, 7, 8, 9, 10), w, 3, f"gate_up stream n{bn} w{w} pdl={pdl}")
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64", "top_k": "i32",
           "num_experts": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_we": "i32",
           "stride_wn": "i32", "stride_om": "i32", "BLOCK_N": C, "BLOCK_K": C}
    compile_report(tm._gemv1_kernel, sig, dict(BLOCK_N=8, BLOCK_K=2048), (0, 1, 2, 3, 6, 7, 8, 9, 10, 11), 8, 3,
                   "gate_up pair (morning) n8 w8")
    sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i64", "wts_ptr": "*bf16",
           "S": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32",
           "stride_om": "i32", "n_tiles": "i32", "BLOCK_S": C, "BLOCK_N": C, "BLOCK_K": C, "PDL": C}
    for bn, w, pdl in [(1, 8, False), (1, 8, True), (1, 4, False), (2, 8, False), (2, 4, False)]:
        compile_report(ms._down_stream_kernel, sig, dict(BLOCK_S=16, BLOCK_N=bn, BLOCK_K=512, PDL=pdl),
                       (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11), w, 3, f"down stream n{bn} w{w} pdl={pdl}")
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*fp32", "logit_ptr": "*fp32", "cnt_ptr": "*i32",
           "wout_ptr": "*bf16", "iout_ptr": "*i64", "T": "i32", "E": "i32", "H": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "scale": "fp32", "TOP_K": C, "SHARED": C, "FIXED": C, "BLOCK_T": C, "BLOCK_E": C,
           "BLOCK_K": C, "BLOCK_ALL": C, "BLOCK_SLOT": C, "SIGMOID": C, "HAS_BIAS": C, "RENORM": C, "ROUND": C,
           "N_GROUP": C, "TOPK_GROUP": C, "GROUP_TOP2": C, "PDL": C}
    for bt, w, pdl in [(1, 4, False), (1, 2, False), (1, 1, False), (4, 2, False), (4, 4, False), (1, 4, True)]:
        consts = dict(TOP_K=10, SHARED=1, FIXED=0, BLOCK_T=bt, BLOCK_E=4, BLOCK_K=min(2048, 2048 * w // (bt * 4)),
                      BLOCK_ALL=512, BLOCK_SLOT=16, SIGMOID=False, HAS_BIAS=False, RENORM=True, ROUND=True,
                      N_GROUP=1, TOPK_GROUP=1, GROUP_TOP2=False, PDL=pdl)
        compile_report(md._route_kernel, sig, consts, (0, 1, 2, 3, 4, 5, 6, 9, 10, 11), w, 3,
                       f"route T{bt} w{w} pdl={pdl}")


if __name__ == "__main__":
    main()
