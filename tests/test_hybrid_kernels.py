"""Reference kernels of the hybrid layers against each other and against plain formulas: chunked vs recurrent
gated delta rule, state carried across chunks, the varlen batch through the state pool, causal conv1d with
its rolling state, and the grouped MoE against a per-token loop."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.conv1d import causal_conv1d_varlen_ref
from lamina.kernels.gated_delta import (
    chunk_gated_delta_rule_ref,
    gated_delta_rule_varlen_ref,
    recurrent_gated_delta_rule_ref,
)
from lamina.kernels.moe import fused_moe_ref, select_experts

HK, HV, DK, DV = 2, 4, 8, 6


def gdn_inputs(length: int, seed: int = 0, batch: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, HK, DK, generator=g)
    k = torch.randn(batch, length, HK, DK, generator=g)
    v = torch.randn(batch, length, HV, DV, generator=g)
    decay = -F.softplus(torch.randn(batch, length, HV, generator=g))  # log decay <= 0
    beta = torch.rand(batch, length, HV, generator=g) * 0.5
    return q, k, v, decay, beta


def test_chunked_equals_recurrent_across_chunk_boundaries():
    q, k, v, g, beta = gdn_inputs(150)
    s0 = torch.randn(1, HV, DK, DV) * 0.1
    out_c, s_c = chunk_gated_delta_rule_ref(q, k, v, g, beta, s0)
    out_r, s_r = recurrent_gated_delta_rule_ref(q, k, v, g, beta, s0)
    torch.testing.assert_close(out_c, out_r, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_c, s_r, atol=1e-4, rtol=1e-4)


def test_state_carries_across_prefill_chunks():
    q, k, v, g, beta = gdn_inputs(100, seed=1)
    whole, s_whole = chunk_gated_delta_rule_ref(q, k, v, g, beta, torch.zeros(1, HV, DK, DV))
    state, outs = torch.zeros(1, HV, DK, DV), []
    for a, b in [(0, 3), (3, 70), (70, 71), (71, 100)]:
        o, state = chunk_gated_delta_rule_ref(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, s_whole, atol=1e-5, rtol=1e-5)


def test_varlen_batch_reads_and_writes_slots():
    """Three sequences in one flat batch: a fresh prefill (its slot holds garbage), a decode token and a later
    prefill chunk (both continuing from their slot's state). Each must equal the sequence run alone."""
    lens, slots, has_init = [10, 1, 70], [2, 0, 1], [False, True, True]
    seqs = [gdn_inputs(n, seed=10 + i) for i, n in enumerate(lens)]
    pool = torch.randn(4, HV, DK, DV)  # slot 3 is never addressed: it must stay untouched
    before = pool.clone()
    flat = [torch.cat([s[j][0] for s in seqs]) for j in range(5)]
    qs = [0, 10, 11, 81]
    out = gated_delta_rule_varlen_ref(*flat, pool, qs, slots, has_init)
    for i, (_n, slot, init) in enumerate(zip(lens, slots, has_init)):
        s0 = before[slot:slot + 1] if init else torch.zeros(1, HV, DK, DV)
        ref, s_ref = recurrent_gated_delta_rule_ref(*seqs[i], s0)
        torch.testing.assert_close(out[qs[i]:qs[i + 1]], ref[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool[slot], s_ref[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(pool[3], before[3])


def test_conv1d_varlen_matches_whole_sequence_conv():
    c, kernel = 5, 4
    w = torch.randn(c, kernel)
    x = torch.randn(40, c)
    whole = F.silu(F.conv1d(x.T[None], w[:, None], padding=kernel - 1, groups=c)[0, :, :40]).T
    pool = torch.randn(3, c, kernel - 1)  # garbage: the first chunk starts at position 0
    outs, start = [], 0
    for n in [2, 1, 1, 7, 29]:  # chunks shorter than the window, single tokens, then longer ones
        outs.append(causal_conv1d_varlen_ref(x[start:start + n], w, None, pool, [0, n], [1], [start > 0]))
        start += n
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1], x[-(kernel - 1):].T)  # the state is the last K-1 inputs


def test_conv1d_mixed_batch_of_decode_and_prefill():
    c, kernel = 3, 4
    w, pool = torch.randn(c, kernel), torch.randn(4, c, kernel - 1)
    before = pool.clone()
    x = torch.randn(1 + 5 + 1, c)
    qs, slots, has_init = [0, 1, 6, 7], [3, 0, 2], [True, False, True]
    out = causal_conv1d_varlen_ref(x, w, None, pool, qs, slots, has_init)
    for i in range(3):
        state = before[slots[i]] if has_init[i] else torch.zeros(c, kernel - 1)
        full = torch.cat([state, x[qs[i]:qs[i + 1]].T], dim=1)
        ref = F.silu(F.conv1d(full[None], w[:, None], groups=c)[0]).T
        torch.testing.assert_close(out[qs[i]:qs[i + 1]], ref)
        torch.testing.assert_close(pool[slots[i]], full[:, -(kernel - 1):])
    assert torch.equal(pool[1], before[1])


def test_moe_matches_per_token_loop():
    torch.manual_seed(0)
    t, h, i, e, top_k = 9, 8, 6, 5, 2
    x, w13, w2 = torch.randn(t, h), torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    logits = torch.randn(t, e)
    for renormalize in (False, True):
        weights, ids = select_experts(logits, top_k, renormalize)
        probs = logits.softmax(-1)
        assert torch.equal(ids, probs.topk(top_k).indices)
        expect_w = probs.topk(top_k).values
        if renormalize:
            expect_w = expect_w / expect_w.sum(-1, keepdim=True)
        torch.testing.assert_close(weights, expect_w)
        ref = torch.zeros(t, h)
        for tok in range(t):
            for slot in range(top_k):
                ex = int(ids[tok, slot])
                gate, up = (w13[ex] @ x[tok]).chunk(2)
                ref[tok] += weights[tok, slot] * (w2[ex] @ (F.silu(gate) * up))
        torch.testing.assert_close(fused_moe_ref(x, w13, w2, weights, ids), ref, atol=1e-5, rtol=1e-5)
