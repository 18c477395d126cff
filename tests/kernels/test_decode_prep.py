"""The decode attention kernel with the prep folded in (decode_prep.py) against qk_norm_rope_store_ref then
paged_attention_ref, on fresh random inputs: direct and split, with and without q/k norm. Caches: random
context, the new tokens' slots NaN-poisoned so an unwritten K/V shows; fp16/fp32 (interpreter bf16 dots)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, INTERPRET, TOL, rel_err

from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.rope import rope_cos_sin_cache, rope_inv_freq


@pytest.mark.parametrize("splits, norm, fp8", [(1, True, False), (1, False, False), (4, True, False),
                                               (4, False, False), (4, True, True)])
def test_prep_attention_matches_prep_then_attention(splits, norm, fp8):
    """fp8: FP8 caches on both sides (the new token's K/V rounded by each; the kernel reads V as words on
    the GPU), so the written slots may differ by an e4m3 step where the kernel rounds through q's dtype."""
    from lamina.kernels.decode_prep import prep_attention, prep_attention_ref

    dtype = torch.float16 if INTERPRET else torch.bfloat16
    gen = torch.Generator().manual_seed(splits + 2 * norm)
    hq, hkv, d, page = 8, 2, 64, 4
    lens = [5, 11]
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    slots = torch.tensor([int(tables[i, (n - 1) // page]) * page + (n - 1) % page for i, n in enumerate(lens)])

    def meta_on(dev):  # the reference runs on the host, the kernel on DEV: each its own addressing
        return AttentionMetadata(slots.to(dev), torch.arange(3, dtype=torch.int32, device=dev),
                                 torch.tensor(lens, dtype=torch.int32, device=dev), tables.to(dev), [0, 1, 2], lens,
                                 1, max(lens))
    qkv = torch.randn(2, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:, :hq * d].view(2, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(2, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(2, hkv, d)
    kc = torch.randn(8, page, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(8, page, hkv, d, generator=gen).to(dtype)
    for c in (kc, vc):
        c.view(-1, hkv, d)[slots] = float("nan")
    if fp8:
        kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    inv, fac = rope_inv_freq(d, 10000.0, None)
    table = rope_cos_sin_cache(inv, 64, fac)
    pos = torch.tensor([n - 1 for n in lens])
    ws = [(torch.rand(d, generator=gen) + 0.5).to(dtype) for _ in range(2)] if norm else [None, None]
    fl = [w.float() if w is not None else None for w in ws]
    rkc, rvc = (kc.clone(), vc.clone()) if fp8 else (kc.float().clone(), vc.float().clone())
    ref = prep_attention_ref(q.float(), k.float(), v.float(), pos, table, rkc, rvc, meta_on("cpu"), d ** -0.5, None,
                             None, *fl, 1e-6, 0.0)
    gkc, gvc = kc.to(DEV), vc.to(DEV)
    dv = [t.to(DEV) if t is not None else None for t in ws]
    out = prep_attention(q.to(DEV), k.to(DEV), v.to(DEV), pos.to(DEV), table.to(DEV), gkc, gvc, meta_on(DEV), d ** -0.5,
                         None, None, *dv, 1e-6, 0.0, num_splits=splits)
    tol = 3e-2 if fp8 else TOL[dtype]
    assert rel_err(gkc.view(-1, hkv, d)[slots.to(DEV)].float(), rkc.view(-1, hkv, d)[slots].float()) < tol
    assert rel_err(gvc.view(-1, hkv, d)[slots.to(DEV)].float(), rvc.view(-1, hkv, d)[slots].float()) < tol
    assert rel_err(out, ref) < 2 * TOL[dtype]
