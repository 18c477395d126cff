"""`scripts/mamba_ssd_bench.py --ptxas`: the Mamba-2 SSD kernels compiled for sm_90a without a GPU, with their
registers, spills and shared memory from ptxas, at the shape the bench passes (Nemotron-H 8B's mixer)."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch


def _compile_report(fn, types: dict, consts: dict, num_warps: int, num_stages: int = 1) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        t = types[name]
        sig[name] = t if isinstance(t, str) else "i32"
        if (isinstance(t, str) and t.startswith("*")) or (isinstance(t, int) and t % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]  # what the runtime's specialization gives aligned args
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 64),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                         text=True).stderr
    os.unlink(f.name)
    regs, spill = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
    return {"regs": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else 0,
            "smem": k.metadata.shared, "wgmma": "wgmma" in k.asm["ptx"], "warps": num_warps, "stages": num_stages}


def _arg_types(act: str, H: int, P: int, G: int, N: int) -> dict:
    """Argument types at the Nemotron-H shape: activations (x, B, C, dt, y, snapshots) in `act`, x / B / C as views
    of one conv1d output row."""
    row = H * P + 2 * G * N
    return dict(x_ptr=act, dt_ptr=act, alog_ptr="*fp32", dtb_ptr="*fp32", d_ptr="*fp32", b_ptr=act, c_ptr=act,
                hs_ptr=act, y_ptr=act, ssm_ptr="*fp32", state_ptr="*fp32", qs_ptr="*i32", tab_ptr="*i32",
                slot_ptr="*i64", init_ptr="*u8", cand_ptr="*i64", n_chunks=3, dt_min="fp32", dt_max="fp32",
                stride_xt=row, stride_xh=P, stride_xb=row, stride_dt=H + 3, stride_db=H + 3, stride_dh=1,
                stride_bt=row, stride_bb=row, stride_bg=N, stride_ct=row, stride_cb=row, stride_cg=N,
                stride_hc=H * P * N, stride_hh=P * N, stride_hp=N, stride_ss=H * P * N, stride_sh=P * N, stride_sp=N,
                stride_yt=H * P, stride_yb=H * P, stride_yh=P, stride_cand=8)


def ptxas_report(H: int, P: int, G: int, N: int) -> list[dict]:
    """The default tiles' registers, then every compile-time variant the wrapper can launch (fp16 / fp32, no pool,
    no initial state, dt limits, heads per program, BT=128): a variant that does not compile on sm_90a shows
    here instead of on the GPU (the interpreter does not type-check loop-carried values)."""
    from lamina.kernels.triton_mamba_ssd_chunk import _ssd_output_kernel, _ssd_state_kernel, ssd_chunk_tiles
    from lamina.kernels.triton_mamba_ssd_decode import _ssd_decode_kernel, _ssd_verify_kernel, decode_tiles

    out = []

    def add(fn, act, consts, warps, stages=1, **tag):
        try:
            rep = _compile_report(fn, _arg_types(act, H, P, G, N), consts, warps, stages)
        except Exception as exc:  # a failing variant is the finding
            rep = {"error": f"{type(exc).__name__}: {exc}"[-300:]}
        out.append({"kernel": fn.__name__, "act": act[1:], **tag, **rep})

    for act in ("*bf16", "*fp16", "*fp32"):
        dtype = {"*bf16": torch.bfloat16, "*fp16": torch.float16, "*fp32": torch.float32}[act]
        prec = "ieee" if dtype == torch.float32 else "tf32"
        for programs in (128, 1024):
            t = ssd_chunk_tiles(dtype, P, N, programs)
            for pool, init, clamp in ((True, True, False), (False, False, True)) if programs == 128 else ((True,) * 3,):
                add(_ssd_state_kernel, act, dict(HG=H // G, P=P, BP=t.state_bp, N=N, BN=t.state_bn,
                                                 N_BLOCKS=N // t.state_bn, BT=t.bt, HAS_POOL=pool, HAS_INIT=init,
                                                 CLAMP=clamp, PREC=prec),
                    t.state_warps, t.state_stages, BT=t.bt, BP=t.state_bp, BN=t.state_bn, pool=pool, init=init,
                    clamp=clamp)
        for hpp, clamp in ((1, False), (H // G, True), (2, False)):
            add(_ssd_output_kernel, act, dict(HG=H // G, HPP=hpp, P=P, BP=t.out_bp, N=N, BN=N, BNC=t.out_bn, BT=t.bt,
                                              CLAMP=clamp, PREC=prec), t.out_warps, BT=t.bt, BP=t.out_bp, HPP=hpp,
                clamp=clamp)
        bp, bn, w = decode_tiles(P, N)
        for state, init, clamp in ((True, True, False), (True, False, True), (False, False, False)):
            add(_ssd_decode_kernel, act, dict(HG=H // G, P=P, N=N, BLOCK_P=bp, BLOCK_N=bn, HAS_STATE=state,
                                              HAS_INIT=init, CLAMP=clamp), w, BLOCK_P=bp, state=state, init=init)
        for clamp in (False, True):
            add(_ssd_verify_kernel, act, dict(HG=H // G, P=P, N=N, BLOCK_P=bp, BLOCK_N=bn, MAX_LEN=4, CLAMP=clamp), w,
                BLOCK_P=bp, clamp=clamp)
    for hpp, warps in ((1, 8), (H // G, 8)):  # BT=128 candidates of the sweep
        add(_ssd_output_kernel, "*bf16", dict(HG=H // G, HPP=hpp, P=P, BP=64, N=N, BN=N, BNC=64, BT=128, CLAMP=False,
                                              PREC="tf32"), warps, BT=128, BP=64, HPP=hpp)
    add(_ssd_state_kernel, "*bf16", dict(HG=H // G, P=P, BP=64, N=N, BN=N, N_BLOCKS=1, BT=128, HAS_POOL=True,
                                         HAS_INIT=True, CLAMP=False, PREC="tf32"), 8, 2, BT=128, BP=64)
    return out
