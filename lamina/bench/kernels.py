"""`lamina bench gdn-prefill`: the chunked gated delta rule kernel on one long prompt, against the torch
reference (the chunked UT-transform form HF falls back to) in the same run, at a Qwen3-Next layer's shape."""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def add_kernel_bench_parser(bsub) -> None:
    p = bsub.add_parser("gdn-prefill", help="GDN chunked prefill kernel vs the torch reference (one layer)")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--num-k-heads", type=int, default=16)
    p.add_argument("--num-v-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--result-file", default=None)
    p.set_defaults(func=cmd_gdn_prefill)


def _time(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up (compiles)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cmd_gdn_prefill(args: argparse.Namespace) -> int:
    from lamina.bench.common import hardware, report
    from lamina.kernels.attention import AttentionMetadata
    from lamina.kernels.gated_delta import (
        chunk_gated_delta_rule_ref,
        gated_delta_rule_varlen,
    )
    from lamina.kernels.metadata import StateMetadata

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    n, hk, hv, d = args.seq_len, args.num_k_heads, args.num_v_heads, args.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    q, k = (torch.randn(n, hk, d, device=device, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(n, hv, d, device=device, generator=gen, dtype=dtype)
    a, b = (torch.randn(n, hv, device=device, generator=gen, dtype=dtype) for _ in range(2))
    A_log = torch.randn(hv, device=device, generator=gen).to(dtype) * 0.5
    dt_bias = torch.randn(hv, device=device, generator=gen).to(dtype)
    pool = torch.zeros(2, hv, d, d, device=device)
    meta = AttentionMetadata(torch.zeros(n, dtype=torch.long, device=device),
                             torch.tensor([0, n], dtype=torch.int32, device=device),
                             torch.tensor([n], dtype=torch.int32, device=device),
                             torch.zeros(1, 1, dtype=torch.int32, device=device), [0, n], [n], n, n)
    state = StateMetadata(torch.tensor([0], device=device), torch.tensor([False], device=device), [0], [False])
    kernel = lambda: gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, pool, meta, state)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    beta = b.sigmoid()

    def reference():
        return chunk_gated_delta_rule_ref(q[None], k[None], v[None], g[None], beta[None],
                                          torch.zeros(1, hv, d, d, device=device))

    t_kernel = _time(kernel, args.repeats, device)
    t_ref = _time(reference, max(1, args.repeats // 2), device)
    out = kernel().float()
    ref_out, ref_state = reference()
    ref_out = ref_out[0].float()
    err = ((out - ref_out).norm() / ref_out.norm()).item()
    state_err = ((pool[0] - ref_state[0]).norm() / ref_state[0].norm()).item()
    result = {"command": "gdn-prefill", "hardware": hardware(device), "dtype": args.dtype, "seq_len": n,
              "shape": {"num_k_heads": hk, "num_v_heads": hv, "head_dim": d},
              "kernel": {"time_s": t_kernel, "tok_s": n / t_kernel},
              "torch_reference": {"time_s": t_ref, "tok_s": n / t_ref},
              "speedup": t_ref / t_kernel, "rel_err_out": err, "rel_err_state": state_err}
    report(result, args.result_file)
    return 0
