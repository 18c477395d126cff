"""The Triton conv1d verify path (the conv over verify chunks, the state after every chunk token but the last
in candidate slots, after the last in the sequence's own slot) against causal_conv1d_varlen_ref with
candidate slots, on varlen batches mixing verify chunks and one-token rows, fresh and continued states, with
poisoned outputs and untouched-slot checks."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV

from lamina.kernels.conv1d import causal_conv1d_varlen_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens,k", [([3, 1, 4], 4), ([1, 1], 4), ([5], 4), ([2, 6, 1], 3), ([4, 2], 2)])
def test_conv1d_verify_matches_reference(lens, k, dtype):
    from lamina.kernels.triton_conv1d_verify import causal_conv1d_verify_triton

    gen = torch.Generator().manual_seed(sum(lens) * k)
    c, bsz, total, max_len = 24, len(lens), sum(lens), max(lens)
    x = torch.randn(total, c, generator=gen).to(dtype)
    weight = torch.randn(c, k, generator=gen).to(dtype)
    bias = torch.randn(c, generator=gen).to(dtype)
    num_slots = 2 + bsz + total
    pool = torch.randn(num_slots, c, k - 1, generator=gen).to(dtype)
    perm = torch.randperm(num_slots, generator=gen).tolist()
    slots, rest = perm[:bsz], perm[bsz:]
    cand_lists = [[rest.pop() for _ in range(n - 1)] for n in lens]
    cands = torch.zeros(bsz, max(1, max_len - 1), dtype=torch.int64)
    for i, cl in enumerate(cand_lists):
        cands[i, :len(cl)] = torch.tensor(cl, dtype=torch.int64)
    init = [i % 2 == 0 for i in range(bsz)]
    qs = [0] + torch.tensor(lens).cumsum(0).tolist()
    ref_pool = pool.clone()
    ref = causal_conv1d_varlen_ref(x, weight, bias, ref_pool, qs, slots, init, "silu", cand_lists)
    dev_pool = pool.clone().to(DEV)
    out = torch.full((total, c), float("nan"), dtype=dtype, device=DEV)
    causal_conv1d_verify_triton(x.to(DEV), weight.to(DEV), bias.to(DEV), dev_pool,
                                torch.tensor(qs, dtype=torch.int32, device=DEV), torch.tensor(slots, device=DEV),
                                cands.to(DEV), torch.tensor(init, device=DEV), max_len, "silu", out=out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), ref.float(), atol=tol, rtol=tol)
    # candidate windows and own slots written, every other slot untouched (states are copies: exact)
    torch.testing.assert_close(dev_pool.cpu(), ref_pool, atol=0, rtol=0)
    touched = set(slots) | {s for cl in cand_lists for s in cl}
    for s in range(num_slots):
        if s not in touched:
            assert torch.equal(dev_pool[s].cpu(), pool[s])


def test_dispatch_takes_the_verify_kernel(monkeypatch):
    """causal_conv1d_varlen routes a verify step with a device candidate table to the Triton verify path (the
    arguments in the right places): same outputs and states as the reference on the host lists."""
    import lamina.kernels.conv1d as conv1d
    from lamina.kernels.attention import AttentionMetadata
    from lamina.kernels.metadata import StateMetadata

    gen = torch.Generator().manual_seed(7)
    lens, c, k = [4, 1, 3], 16, 4
    total = sum(lens)
    x, weight = torch.randn(total, c, generator=gen), torch.randn(c, k, generator=gen)
    bias = torch.randn(c, generator=gen)
    pool = torch.randn(12, c, k - 1, generator=gen)
    slots, cand_lists, init = [3, 0, 7], [[5, 1, 9], [], [2, 11]], [True, True, False]
    qs = [0] + torch.tensor(lens).cumsum(0).tolist()
    cands = torch.zeros(3, 3, dtype=torch.int64)
    for i, cl in enumerate(cand_lists):
        cands[i, :len(cl)] = torch.tensor(cl, dtype=torch.int64)
    attn = AttentionMetadata(torch.zeros(total, dtype=torch.int64, device=DEV),
                             torch.tensor(qs, dtype=torch.int32, device=DEV), torch.tensor(lens, device=DEV),
                             torch.zeros(3, 1, dtype=torch.int32, device=DEV), qs, lens, max(lens), max(lens))
    state = StateMetadata(torch.tensor(slots, device=DEV), torch.tensor(init, device=DEV), slots, init, cand_lists,
                          cands.to(DEV))
    ref_pool = pool.clone()
    ref = causal_conv1d_varlen_ref(x, weight, bias, ref_pool, qs, slots, init, "silu", cand_lists)
    monkeypatch.setattr(conv1d, "use_triton", lambda t: True)
    dev_pool = pool.clone().to(DEV)
    out = conv1d.causal_conv1d_varlen(x.to(DEV), weight.to(DEV), bias.to(DEV), dev_pool, attn, state, "silu")
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dev_pool.cpu(), ref_pool, atol=0, rtol=0)
