"""The CPU reference's in-place read of one sequence whose blocks are consecutive in the pool (plan_attention's
span) against HF-style direct attention and against the gathered path on a scattered copy of the same
context: decode and prefill chunks, with and without a sliding window and soft-capping, the tail block
partly filled, and stale data past the context (which only the mask or the span's end keeps out)."""
from __future__ import annotations

import pytest
import torch
from test_attention_softcap import direct_attention

from lamina.kernels.attention import AttentionMetadata, paged_attention_ref, plan_attention

PAGE, HQ, HKV, D = 16, 6, 2, 32


def _meta(table: list[int], seq_len: int, qlen: int) -> AttentionMetadata:
    slots = [table[p // PAGE] * PAGE + p % PAGE for p in range(seq_len - qlen, seq_len)]
    return AttentionMetadata(torch.tensor(slots), torch.tensor([0, qlen], dtype=torch.int32),
                             torch.tensor([seq_len], dtype=torch.int32), torch.tensor([table], dtype=torch.int32),
                             [0, qlen], [seq_len], qlen, seq_len)


@pytest.mark.parametrize("qlen, seq_len", [(1, 1), (1, 37), (1, 48), (9, 41), (41, 41)])
@pytest.mark.parametrize("window, softcap", [(None, None), (13, None), (None, 4.0)])
def test_span_matches_gather_and_direct(qlen, seq_len, window, softcap):
    gen = torch.Generator().manual_seed(qlen * 100 + seq_len)
    n_blocks = -(-seq_len // PAGE)
    kc = torch.randn(12, PAGE, HKV, D, generator=gen)  # every slot holds data: stale keys must stay out
    vc = torch.randn(12, PAGE, HKV, D, generator=gen)
    q = torch.randn(qlen, HQ, D, generator=gen)
    run = list(range(3, 3 + n_blocks))
    scattered = [11 - 2 * i for i in range(n_blocks)]
    for a, b in zip(run, scattered):  # the same context at other blocks
        kc[b], vc[b] = kc[a], vc[a]
    m_run, m_scat = _meta(run, seq_len, qlen), _meta(scattered, seq_len, qlen)
    plan = plan_attention(m_run, PAGE, (window,))
    assert plan.groups[0].span == (3 * PAGE, seq_len)
    assert plan_attention(m_scat, PAGE, (window,)).groups[0].span is None or n_blocks == 1
    scale = D ** -0.5 * 3
    got = paged_attention_ref(q, kc, vc, m_run, scale, window, softcap)
    gathered = paged_attention_ref(q, kc, vc, m_scat, scale, window, softcap)
    want = direct_attention(q, kc, vc, m_run, scale, window, softcap)
    assert (got.double() - want).abs().max() < 1e-5
    assert (gathered.double() - want).abs().max() < 1e-5
