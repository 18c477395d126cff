"""The Triton verify kernel (recurrent gated delta rule keeping the state after every token) against
recurrent_verify_ref, on a varlen batch mixing verify chunks and one-token decode rows, with poisoned outputs
and untouched-slot checks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import DEV

from lamina.kernels.gated_delta import recurrent_verify_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [[3, 1, 4], [1, 1], [5]])
def test_gdn_verify_matches_reference(lens, dtype):
    from lamina.kernels.triton_gdn_verify import gated_delta_verify_triton

    gen = torch.Generator().manual_seed(sum(lens))
    hk, hv, dk, dv = 2, 4, 16, 32
    total, bsz, max_len = sum(lens), len(lens), max(lens)
    q = torch.randn(total, hk, dk, generator=gen).to(dtype)
    k = torch.randn(total, hk, dk, generator=gen).to(dtype)
    v = torch.randn(total, hv, dv, generator=gen).to(dtype)
    a_raw = torch.randn(total, hv, generator=gen).to(dtype)
    b_raw = torch.randn(total, hv, generator=gen).to(dtype)
    a_log = 0.5 * torch.randn(hv, generator=gen)
    dt_bias = torch.randn(hv, generator=gen)
    num_slots = 1 + bsz + sum(lens)
    pool = torch.randn(num_slots, hv, dk, dv, generator=gen)
    perm = torch.randperm(num_slots, generator=gen).tolist()
    slots, rest = perm[:bsz], perm[bsz:]
    cands = torch.zeros(bsz, max(1, max_len - 1), dtype=torch.int64)
    cand_lists = []
    for i, n in enumerate(lens):
        c = [rest.pop() for _ in range(n - 1)]
        cand_lists.append(c)
        cands[i, :len(c)] = torch.tensor(c, dtype=torch.int64)
    init = torch.tensor([i % 2 == 0 for i in range(bsz)])
    qs = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    # the reference, per sequence, on a copy of the pool
    ref_pool = pool.clone()
    g = -a_log.exp() * F.softplus(a_raw.float() + dt_bias)
    beta = b_raw.float().sigmoid()
    ref_out = torch.empty(total, hv, dv)
    for i in range(bsz):
        r = slice(int(qs[i]), int(qs[i + 1]))
        state = pool[slots[i]][None].clone() if init[i] else torch.zeros(1, hv, dk, dv)
        ref_out[r] = recurrent_verify_ref(q[r].float(), k[r].float(), v[r].float(), g[r], beta[r], state, ref_pool,
                                          cand_lists[i], slots[i])
    dev_pool = pool.clone().to(DEV)
    out = torch.full((total, hv, dv), float("nan"), dtype=dtype, device=DEV)
    gated_delta_verify_triton(q.to(DEV), k.to(DEV), v.to(DEV), a_raw.to(DEV), b_raw.to(DEV), a_log.to(DEV),
                              dt_bias.to(DEV), dev_pool, qs.to(DEV), torch.tensor(slots).to(DEV), cands.to(DEV),
                              init.to(DEV), max_len, out=out)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), ref_out.to(dtype).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(dev_pool.cpu(), ref_pool, atol=1e-4, rtol=1e-4)  # written slots; others untouched
