"""A gated delta net layer's kernels (conv1d, then the gated delta rule) on the exact padded metadata a CUDA
graph replays with (graph_inputs.GraphInputs with a state pool, host fields of the key only), against the torch
references on the unpadded step.

Checked: real rows match; the real sequences' conv and recurrent states match; pool slots outside the batch
(NaN) are untouched; the padding slot is NaN too, so a padded row that read it would come out non-finite
(padded sequences start from zeros); stale buffer contents from earlier steps do not leak into the replay.
Runs on a GPU or through Triton's interpreter (fp32 / fp16)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_helpers import CUDA, DEV, TOL, rel_err

from lamina.engine.graph_inputs import GraphInputs
from lamina.engine.graph_keys import GraphKey, choose_key, decode_batch_sizes, mixed_token_sizes
from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.conv1d import causal_conv1d_varlen_ref
from lamina.kernels.gated_delta import gated_delta_rule_varlen_ref
from lamina.kernels.gdn_gates import gdn_gates
from lamina.kernels.metadata import StateMetadata, StepContext

HK, HV, DK, DV, K = 1, 2, 16, 16, 4
C = 2 * HK * DK + HV * DV
NUM_SLOTS = 12  # the pool has NUM_SLOTS + 1 rows, the last one the padding slot

# (query lengths, has_initial_state, forced key or None (choose_key's), max_num_seqs)
CASES = {
    "mixed": ([1, 70, 1, 1, 9, 2], [True, False, True, True, True, False], None, 8),
    "prefill_only": ([33, 64], [False, True], None, 8),
    "decode_graph": ([1, 1, 1], [True, False, True], None, 8),
    "decode_on_mixed_graph": ([1, 1, 1, 1], [True, True, False, True], GraphKey(32, 9, False), 8),
    "wide_padding": ([1, 5, 1], [True, True, True], GraphKey(160, 9, False), 8),  # tail rows > one chunk
    "full_key": ([16, 16], [True, False], GraphKey(32, 9, False), 8),  # no padding rows at all
}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _step(lens, init, gen):
    b = len(lens)
    qs = [0]
    for n in lens:
        qs.append(qs[-1] + n)
    slots = torch.randperm(NUM_SLOTS, generator=gen)[:b].tolist()
    meta = AttentionMetadata(torch.full((qs[-1],), -1, dtype=torch.long, device=DEV),
                             torch.tensor(qs, dtype=torch.int32, device=DEV),
                             torch.tensor(lens, dtype=torch.int32, device=DEV),
                             torch.zeros(b, 1, dtype=torch.int32, device=DEV), qs, list(lens), max(lens), max(lens))
    state = StateMetadata(torch.tensor(slots, device=DEV), torch.tensor(init, device=DEV), slots, init)
    return qs, slots, meta, state


def _pools(gen, slots, init, dtype):
    conv = torch.full((NUM_SLOTS + 1, C, K - 1), float("nan"), dtype=dtype)
    ssm = torch.full((NUM_SLOTS + 1, HV, DK, DV), float("nan"))
    for s, live in zip(slots, init):
        if live:
            conv[s] = torch.randn(C, K - 1, generator=gen).to(dtype)
            ssm[s] = 0.3 * torch.randn(HV, DK, DV, generator=gen)
    return conv.to(DEV), ssm.to(DEV)


def _split(qkv):
    t = qkv.shape[0]
    q, k, v = qkv.split([HK * DK, HK * DK, HV * DV], dim=-1)
    return q.reshape(t, HK, DK), k.reshape(t, HK, DK), v.reshape(t, HV, DV)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", list(CASES))
def test_gdn_layer_kernels_on_padded_graph_metadata(case, dtype):
    from lamina.kernels.triton_conv1d import causal_conv1d_varlen_triton
    from lamina.kernels.triton_gated_delta import gated_delta_rule_varlen_triton

    lens, init, key, max_num_seqs = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    qs, slots, meta, state = _step(lens, init, gen)
    t = qs[-1]
    key = key or choose_key(t, len(lens), meta.is_decode_only, decode_batch_sizes(max_num_seqs),
                            mixed_token_sizes(256), max_num_seqs)
    assert key is not None and key.decode == (case == "decode_graph")
    pad_slot = NUM_SLOTS
    inputs = GraphInputs(256, max_num_seqs + 1, 1, DEV, padding_slot=pad_slot)
    # what earlier steps left behind must not matter: a live slot and live flags in every stale entry
    inputs.state_slots.fill_(slots[0])
    inputs.has_initial_state.fill_(True)
    inputs.mixed_query_start.fill_(3)
    batch = SimpleNamespace(input_ids=torch.zeros(t, dtype=torch.long, device=DEV),
                            positions=torch.zeros(t, dtype=torch.long, device=DEV), ctx=StepContext(meta, state))
    inputs.load(batch, key)
    gctx = inputs.context(key, max_model_len=4096)
    assert gctx.attn.query_start_cpu == ([] if not key.decode else gctx.attn.query_start_cpu)

    tp = key.tokens
    x = (torch.randn(tp, C, generator=gen)).to(dtype).to(DEV)
    a = torch.randn(tp, HV, generator=gen).to(dtype).to(DEV)
    bb = torch.randn(tp, HV, generator=gen).to(dtype).to(DEV)
    w = (0.5 * torch.randn(C, K, generator=gen)).to(dtype).to(DEV)
    a_log = torch.randn(HV, generator=gen).to(DEV)
    dt_bias = torch.randn(HV, generator=gen).to(DEV)
    conv, ssm = _pools(gen, slots, init, dtype)
    conv_ref, ssm_ref = conv.float().clone(), ssm.clone()

    # the oracle: the references on the unpadded step, fp32
    y_ref = causal_conv1d_varlen_ref(x[:t].float(), w.float(), None, conv_ref, qs, slots, init)
    g, beta = gdn_gates(a[:t].float(), bb[:t].float(), a_log, dt_bias)
    o_ref = gated_delta_rule_varlen_ref(*_split(y_ref), g, beta, ssm_ref, qs, slots, init)

    # the graph's path: the Triton kernels on the padded batch, choices from the key's host fields only
    y = causal_conv1d_varlen_triton(x, w, None, conv, gctx.attn.query_start, gctx.state.slots,
                                    gctx.state.has_initial_state, gctx.attn.max_query_len)
    o = gated_delta_rule_varlen_triton(*_split(y), a, bb, a_log, dt_bias, ssm, gctx.attn, gctx.state)

    assert rel_err(y[:t], y_ref) < TOL[dtype]
    assert rel_err(o[:t], o_ref) < TOL[dtype] * (3 if dtype != torch.float32 else 1)
    assert torch.isfinite(o[t:].float()).all() and torch.isfinite(y[t:].float()).all(), \
        "a padded row read the (poisoned) padding slot"
    others = [s for s in range(NUM_SLOTS) if s not in slots]
    assert conv[others].isnan().all() and ssm[others].isnan().all(), "a slot outside the batch was written"
    assert torch.equal(conv[slots].float(), conv_ref[slots])  # conv states are copies of inputs: exact
    assert rel_err(ssm[slots], ssm_ref[slots]) < TOL[dtype] * (3 if dtype != torch.float32 else 1)
