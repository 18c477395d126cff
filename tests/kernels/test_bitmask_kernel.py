"""The Triton bitmask kernel (lamina/kernels/triton_bitmask.py) against the torch reference (allowed_tokens):
in place, over chosen rows, and as a masked copy, with a vocabulary that does not fill its last word and
masks of every kind a grammar makes (mostly allowed, mostly banned, bit 31 set, all banned)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import CUDA

from lamina.structured.bitmask import allowed_tokens

DEV = "cuda" if CUDA else "cpu"


def _masks(n: int, width: int, gen: torch.Generator) -> torch.Tensor:
    m = torch.randint(-2**31, 2**31 - 1, (n, width), dtype=torch.int64, generator=gen).to(torch.int32)
    m[0] = -1  # all allowed
    m[1] = 0
    m[1, 3] = -2**31  # only bit 31 of one word: the sign bit
    if n > 2:
        m[2, ::7] = 0  # mostly allowed with whole banned words
    return m


def _reference(logits, bitmask, rows):
    out = logits.clone()
    r = rows if rows is not None else torch.arange(bitmask.shape[0])
    out[r] = out[r].masked_fill(~allowed_tokens(bitmask, logits.shape[1]), float("-inf"))
    return out


@pytest.mark.parametrize("vocab", [4096 + 37, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_in_place_matches_torch(vocab, dtype):
    from lamina.kernels.triton_bitmask import apply_bitmask_triton

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen).to(dtype)
    bitmask = _masks(4, (vocab + 31) // 32, gen)
    want = _reference(logits, bitmask, None)
    got = logits.to(DEV)
    apply_bitmask_triton(got, bitmask.to(DEV))
    assert torch.equal(got.cpu(), want)
    assert torch.isinf(want).any() and torch.isfinite(want).any()  # the case masks and keeps


def test_apply_chosen_rows_leaves_the_others():
    from lamina.kernels.triton_bitmask import apply_bitmask_triton

    gen = torch.Generator().manual_seed(1)
    vocab = 4096 + 5
    logits = torch.randn(6, vocab, generator=gen)
    bitmask = _masks(3, (vocab + 31) // 32, gen)
    rows = torch.tensor([4, 0, 2])
    want = _reference(logits, bitmask, rows)
    got = logits.to(DEV)
    apply_bitmask_triton(got, bitmask.to(DEV), rows.to(DEV))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got.cpu()[[1, 3, 5]], logits[[1, 3, 5]])


def test_masked_copy_keeps_the_source():
    from lamina.kernels.triton_bitmask import masked_copy_triton

    gen = torch.Generator().manual_seed(2)
    vocab = 300
    logits = torch.randn(3, vocab, generator=gen)
    bitmask = _masks(3, (vocab + 31) // 32 + 1, gen)  # a wider mask (padding words) is allowed
    src = logits.to(DEV)
    out = masked_copy_triton(src, bitmask.to(DEV))
    assert torch.equal(out.cpu(), _reference(logits, bitmask, None))
    assert torch.equal(src.cpu(), logits)
