"""The Mamba-2 SSD torch references (recurrent, chunked, varlen over a state pool, verify) against the per-token
float64 oracle of mamba_ssd_cases, and the dispatch on StepContext-style metadata (CPU: the reference)."""
from __future__ import annotations

import pytest
import torch
from mamba_ssd_cases import make_batch, oracle_seq, oracle_varlen, rel

from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.mamba_ssd import mamba_ssd_varlen, mamba_ssd_varlen_ref, ssd_chunked_ref, ssd_dt, ssd_recurrent_ref
from lamina.kernels.metadata import StateMetadata


def _meta(bt, candidates=None):
    qs, lens = bt.query_start, [bt.query_start[i + 1] - bt.query_start[i] for i in range(len(bt.slots))]
    attn = AttentionMetadata(torch.full((qs[-1],), -1, dtype=torch.long), torch.tensor(qs, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), torch.zeros(len(lens), 1, dtype=torch.int32),
                             qs, lens, max(lens), max(lens))
    state = StateMetadata(torch.tensor(bt.slots), torch.tensor(bt.init), bt.slots, bt.init, candidates)
    return attn, state


@pytest.mark.parametrize("length,chunk", [(1, 16), (5, 16), (16, 16), (37, 16), (130, 64), (70, 256)])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_chunked_and_recurrent_match_oracle(length, chunk, groups):
    bt = make_batch([length], heads=4, head_dim=8, groups=groups, dstate=6, dtype=torch.float32, seed=length + groups,
                    init=[True])
    s0 = bt.pool[bt.slots[0]]
    want, states = oracle_seq(bt.x, bt.dt, bt.A_log, bt.B, bt.C, bt.D, bt.dt_bias, s0)
    dtp, A = ssd_dt(bt.dt, bt.dt_bias), -bt.A_log.exp()
    y, s = ssd_chunked_ref(bt.x, dtp, A, bt.B, bt.C, bt.D, s0, chunk)
    assert rel(y, want) < 1e-5 and rel(s, states[-1]) < 1e-5
    y, s = ssd_recurrent_ref(bt.x[None], dtp[None], A, bt.B[None], bt.C[None], bt.D, s0[None])
    assert rel(y[0], want) < 1e-5 and rel(s[0], states[-1]) < 1e-5


def test_chunk_size_changes_only_rounding():
    bt = make_batch([300], heads=2, head_dim=4, groups=1, dstate=8, dtype=torch.float32, seed=3, init=[False])
    dtp, A, s0 = ssd_dt(bt.dt, bt.dt_bias), -bt.A_log.exp(), torch.zeros(2, 4, 8)
    outs = [ssd_chunked_ref(bt.x, dtp, A, bt.B, bt.C, bt.D, s0, c) for c in (32, 64, 128, 256)]
    for y, s in outs[1:]:
        assert rel(y, outs[0][0]) < 1e-5 and rel(s, outs[0][1]) < 1e-5


def test_dt_clamp():
    dt, bias = torch.tensor([[-30.0, 0.0, 3.0]]), torch.zeros(3)
    torch.testing.assert_close(ssd_dt(dt, bias, 0.01, 1.0), torch.tensor([[0.01, 0.6931472, 1.0]]))
    torch.testing.assert_close(ssd_dt(dt, bias), torch.nn.functional.softplus(dt))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [[1, 40, 1, 1, 9, 2], [33, 64], [1, 1, 1], [17], [300, 1, 3]])
def test_varlen_ref_matches_oracle(lens, dtype):
    """Mixed decode / prefill / continuation rows; fresh sequences' slots and slots outside the batch hold NaN (read
    -> non-finite output; written -> compared with the oracle's untouched NaN)."""
    bt = make_batch(lens, heads=4, head_dim=8, groups=2, dstate=16, dtype=dtype, seed=len(lens) + sum(lens))
    want, want_pool = oracle_varlen(bt)
    pool = bt.pool.clone()
    y = mamba_ssd_varlen_ref(bt.x, bt.dt, bt.A_log, bt.B, bt.C, bt.D, bt.dt_bias, pool, bt.query_start, bt.slots,
                             bt.init, chunk_size=16)
    assert y.dtype == dtype and y.shape == bt.x.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding (math is fp32)
    assert rel(y, want) < tol
    torch.testing.assert_close(pool, want_pool, atol=1e-4, rtol=1e-4, equal_nan=True)


def test_varlen_ref_without_pool_is_zero_state():
    bt = make_batch([5, 1, 20], heads=2, head_dim=4, groups=1, dstate=8, dtype=torch.float32, seed=11,
                    init=[False] * 3)
    want, _ = oracle_varlen(bt)
    y = mamba_ssd_varlen_ref(bt.x, bt.dt, bt.A_log, bt.B, bt.C, bt.D, bt.dt_bias, None, bt.query_start, None,
                             [True] * 3, chunk_size=8)
    assert rel(y, want) < 1e-5


def test_varlen_ref_dt_limits():
    bt = make_batch([12, 1], heads=2, head_dim=4, groups=2, dstate=4, dtype=torch.float32, seed=5)
    want, want_pool = oracle_varlen(bt, dt_min=0.02, dt_max=0.05)
    pool = bt.pool.clone()
    y = mamba_ssd_varlen_ref(bt.x, bt.dt, bt.A_log, bt.B, bt.C, bt.D, bt.dt_bias, pool, bt.query_start, bt.slots,
                             bt.init, dt_min=0.02, dt_max=0.05, chunk_size=8)
    assert rel(y, want) < 1e-5
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_verify_writes_every_state():
    lens = [3, 1, 4]
    bt = make_batch(lens, heads=4, head_dim=4, groups=2, dstate=8, dtype=torch.float32, seed=21,
                    init=[True, True, False], extra_slots=8)
    free = [s for s in range(bt.pool.shape[0]) if s not in bt.slots]
    cands = [free[:2], [], free[2:5]]
    want, want_pool = oracle_varlen(bt, candidates=cands)
    pool = bt.pool.clone()
    y = mamba_ssd_varlen_ref(bt.x, bt.dt, bt.A_log, bt.B, bt.C, bt.D, bt.dt_bias, pool, bt.query_start, bt.slots,
                             bt.init, candidate_slots=cands)
    assert rel(y, want) < 1e-5
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5, equal_nan=True)
    with pytest.raises(ValueError, match="candidate slots"):
        mamba_ssd_varlen_ref(bt.x, bt.dt, bt.A_log, bt.B, bt.C, bt.D, bt.dt_bias, bt.pool.clone(), bt.query_start,
                             bt.slots, bt.init, candidate_slots=[free[:1], [], free[2:5]])


def test_dispatch_on_step_metadata():
    """mamba_ssd_varlen on host metadata equals the reference; state None (profiling) writes nothing."""
    bt = make_batch([7, 1, 30, 1], heads=4, head_dim=8, groups=4, dstate=8, dtype=torch.float32, seed=2)
    attn, state = _meta(bt)
    want, want_pool = oracle_varlen(bt)
    pool = bt.pool.clone()
    y = mamba_ssd_varlen(bt.x, bt.dt, bt.A_log, bt.B, bt.C, bt.D, bt.dt_bias, pool, attn, state, chunk_size=16)
    assert rel(y, want) < 1e-5
    torch.testing.assert_close(pool, want_pool, atol=1e-5, rtol=1e-5, equal_nan=True)
    pool = bt.pool.clone()
    y = mamba_ssd_varlen(bt.x, bt.dt, bt.A_log, bt.B, bt.C, bt.D, bt.dt_bias, pool, attn, None)
    assert torch.isfinite(y).all() and torch.equal(pool.nan_to_num(7.0), bt.pool.nan_to_num(7.0))
