"""The Triton MLA kernels against their torch references (kernels/mla_decode.py) on fresh random inputs: the
latent store (padding slots skipped, every other slot left as it was) and the absorbed-form decode over a
paged latent cache with shuffled block tables, contexts across block boundaries, padding sequences (seq_len
0: zeros), head counts that do not fill a 16-head tile, non-power-of-two latent widths, and split-K with
empty splits. Outputs are NaN-poisoned; unused cache blocks hold NaN, so a read outside a sequence shows.
bf16 runs on a GPU only (Triton 3.6's interpreter computes bf16 dots on raw bits); fp16 stands in there."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, INTERPRET, TOL, rel_err

from lamina.kernels.mla_decode import mla_decode_ref, store_latent_ref


def _case(batch: int, heads: int, c: int, r: int, page: int, lens: list[int], dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max((n + page - 1) // page for n in lens) + 1
    num_blocks = batch * max_blocks + 3
    cache = torch.full((num_blocks, page, c + r), float("nan"))
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    for i, n in enumerate(lens):
        ids = perm[i * max_blocks:(i + 1) * max_blocks]
        tables[i] = ids.int()
        used = (n + page - 1) // page
        cache[ids[:used]] = torch.randn(used, page, c + r, generator=g)  # tail slots of the last block: data too
    q_lat = torch.randn(batch, heads, c, generator=g)
    q_pe = torch.randn(batch, heads, r, generator=g)
    to = dict(device=DEV)
    return (q_lat.to(dtype).to(**to), q_pe.to(dtype).to(**to), cache.to(dtype).to(**to), tables.to(**to),
            torch.tensor(lens, dtype=torch.int32, device=DEV))


CASES = [  # batch, heads, latent, rope, page, seq lens, forced splits (None: the heuristic)
    (3, 4, 32, 16, 4, [1, 9, 17], None),
    (4, 20, 48, 16, 16, [33, 0, 5, 64], 3),  # 2 head tiles, a padding sequence, C not a power of two
    (2, 16, 64, 32, 8, [200, 7], 4),  # the short sequence's later splits are empty
    (1, 2, 32, 16, 4, [70], 1),
]


@pytest.mark.parametrize("batch,heads,c,r,page,lens,splits", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mla_decode_matches_reference(batch, heads, c, r, page, lens, splits, dtype):
    from lamina.kernels.triton_mla_decode import mla_decode_triton

    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("interpreter bf16 dots are wrong")
    q_lat, q_pe, cache, tables, seq_lens = _case(batch, heads, c, r, page, lens, dtype, seed=len(lens) + heads)
    scale = (c + r) ** -0.5
    ref = mla_decode_ref(q_lat.float().cpu(), q_pe.float().cpu(), cache.float().cpu(), tables.cpu(),
                         seq_lens.cpu(), scale)
    out = mla_decode_triton(q_lat, q_pe, cache, tables, seq_lens, scale, max(lens), splits=splits)
    assert out.dtype == dtype and out.shape == (batch, heads, c)
    assert rel_err(out, ref) <= TOL[dtype]
    for i, n in enumerate(lens):
        if n == 0:
            assert (out[i] == 0).all(), "a padding sequence must come out as zeros"


def test_mla_decode_heuristic_splits_match_one_split():
    from lamina.kernels.triton_mla_decode import mla_decode_triton, num_splits

    q_lat, q_pe, cache, tables, seq_lens = _case(2, 4, 32, 16, 4, [300, 2], torch.float32, seed=7)
    assert num_splits(2, 1, 300) > 1
    one = mla_decode_triton(q_lat, q_pe, cache, tables, seq_lens, 0.2, 300, splits=1)
    many = mla_decode_triton(q_lat, q_pe, cache, tables, seq_lens, 0.2, 300)
    assert rel_err(many, one) <= 1e-5


def test_store_latent_matches_reference_and_skips_padding():
    from lamina.kernels.triton_mla_decode import store_latent_triton

    g = torch.Generator().manual_seed(3)
    c, r, page, blocks, t = 48, 16, 4, 6, 7
    latent, k_pe = torch.randn(t, c, generator=g), torch.randn(t, r, generator=g)
    slots = torch.tensor([5, -1, 0, 23, 11, -1, 12])
    ref = torch.full((blocks, page, c + r), float("nan"))
    store_latent_ref(latent, k_pe, ref, slots)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((blocks, page, c + r), float("nan"), dtype=dtype, device=DEV)
        store_latent_triton(latent.to(dtype).to(DEV), k_pe.to(dtype).to(DEV), out, slots.to(DEV))
        flat, want = out.float().cpu().flatten(0, 1), ref.to(dtype).float().flatten(0, 1)
        written = slots[slots >= 0]
        assert torch.equal(flat[written], want[written])
        rest = torch.ones(flat.shape[0], dtype=torch.bool)
        rest[written] = False
        assert flat[rest].isnan().all(), "a slot outside slot_mapping was written"


def test_fp8_latent_cache_store_and_decode():
    """An e4m3 cache: the store saturates like the reference's (+-448, not NaN), the decode widens it and
    matches the reference on the same FP8 contents."""
    from lamina.kernels.triton_mla_decode import mla_decode_triton, store_latent_triton

    g = torch.Generator().manual_seed(11)
    c, r, page, blocks = 32, 16, 4, 8
    t = blocks * page
    latent, k_pe = torch.randn(t, c, generator=g) * 3, torch.randn(t, r, generator=g)
    latent[0, :4] = torch.tensor([1000.0, -1000.0, 448.0, 0.5])
    slots = torch.randperm(t, generator=g)
    ref = torch.zeros(blocks, page, c + r, dtype=torch.float8_e4m3fn)
    store_latent_ref(latent, k_pe, ref, slots)
    cache = torch.zeros(blocks, page, c + r, dtype=torch.float8_e4m3fn, device=DEV)
    store_latent_triton(latent.to(DEV), k_pe.to(DEV), cache, slots.to(DEV))
    from test_fp8_kv import assert_fp8_close  # equal on a GPU; the interpreter's fp8 cast is let off by a step

    assert_fp8_close(cache, ref, slots)
    cache.copy_(ref.to(DEV))  # decode on the reference's exact contents
    tables = torch.arange(blocks, dtype=torch.int32).view(2, 4).to(DEV)
    lens = torch.tensor([13, 16], dtype=torch.int32, device=DEV)
    q_lat = torch.randn(2, 4, c, generator=g).half().to(DEV)
    q_pe = torch.randn(2, 4, r, generator=g).half().to(DEV)
    out = mla_decode_triton(q_lat, q_pe, cache, tables, lens, 0.1, 16, splits=2)
    expect = mla_decode_ref(q_lat.float().cpu(), q_pe.float().cpu(), ref, tables.cpu(), lens.cpu(), 0.1)
    assert rel_err(out, expect) <= TOL[torch.float16]
