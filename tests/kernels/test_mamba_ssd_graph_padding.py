"""The Mamba-2 SSD kernels on the exact padded metadata a CUDA graph replays with (graph_inputs.GraphInputs with a
state pool, host fields of the key only), against the torch reference on the unpadded step.

Checked: real rows match; the real sequences' states match; pool slots outside the batch (NaN) stay untouched;
the padding slot is NaN too, so a padded row that read it would come out non-finite (padded sequences start
from zeros); stale buffer contents from earlier steps do not leak into the replay. Runs on a GPU or through
Triton's interpreter (fp32 / fp16: the interpreter computes bf16 dots on raw bits)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_helpers import CUDA, DEV, TOL, rel_err

from lamina.engine.graph_inputs import GraphInputs
from lamina.engine.graph_keys import GraphKey, choose_key, decode_batch_sizes, mixed_token_sizes
from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.mamba_ssd import mamba_ssd_varlen_ref
from lamina.kernels.metadata import StateMetadata, StepContext

H, P, G, N = 4, 8, 2, 16
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


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", list(CASES))
def test_ssd_on_padded_graph_metadata(case, dtype):
    from lamina.kernels.triton_mamba_ssd import mamba_ssd_varlen_triton

    lens, init, key, max_num_seqs = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    qs, slots, meta, state = _step(lens, init, gen)
    t = qs[-1]
    key = key or choose_key(t, len(lens), meta.is_decode_only, decode_batch_sizes(max_num_seqs),
                            mixed_token_sizes(256), max_num_seqs)
    assert key is not None and key.decode == (case == "decode_graph")
    inputs = GraphInputs(256, max_num_seqs + 1, 1, DEV, padding_slot=NUM_SLOTS)
    # what earlier steps left behind must not matter: a live slot and live flags in every stale entry
    inputs.state_slots.fill_(slots[0])
    inputs.has_initial_state.fill_(True)
    inputs.mixed_query_start.fill_(3)
    batch = SimpleNamespace(input_ids=torch.zeros(t, dtype=torch.long, device=DEV),
                            positions=torch.zeros(t, dtype=torch.long, device=DEV), ctx=StepContext(meta, state))
    inputs.load(batch, key)
    gctx = inputs.context(key, max_model_len=4096)

    tp = key.tokens
    x = torch.randn(tp, H, P, generator=gen).to(dtype).to(DEV)
    dt = (0.5 * torch.randn(tp, H, generator=gen)).to(dtype).to(DEV)
    B = torch.randn(tp, G, N, generator=gen).to(dtype).to(DEV)
    C = torch.randn(tp, G, N, generator=gen).to(dtype).to(DEV)
    a_log = torch.log(1 + 15 * torch.rand(H, generator=gen)).to(DEV)
    dt_bias = (-4.0 + torch.randn(H, generator=gen)).to(DEV)
    D = torch.randn(H, generator=gen).to(DEV)
    ssm = torch.full((NUM_SLOTS + 1, H, P, N), float("nan"))
    for s, live in zip(slots, init):
        if live:
            ssm[s] = 0.5 * torch.randn(H, P, N, generator=gen)
    ssm = ssm.to(DEV)
    ssm_ref = ssm.clone()

    ref = mamba_ssd_varlen_ref(x[:t].float(), dt[:t].float(), a_log, B[:t].float(), C[:t].float(), D, dt_bias,
                               ssm_ref, qs, slots, init)
    y = mamba_ssd_varlen_triton(x, dt, a_log, B, C, D, dt_bias, ssm, gctx.attn, gctx.state)

    assert rel_err(y[:t], ref) < TOL[dtype]
    assert torch.isfinite(y[t:].float()).all(), "a padded row read the (poisoned) padding slot"
    others = [s for s in range(NUM_SLOTS) if s not in slots]
    assert ssm[others].isnan().all(), "a slot outside the batch was written"
    assert rel_err(ssm[slots], ssm_ref[slots]) < TOL[dtype]
