"""The Mamba-2 selective state-space recurrence (SSD), with a state per sequence in the state pool.

Per head h (P = head_dim values, N = state size), with state S [P, N] and a token (x [P], raw dt, B [N], C [N]):
    dt <- clamp(softplus(dt + dt_bias[h]), dt_min, dt_max);  A = -exp(A_log[h])
    S <- exp(dt A) S + dt x B^T;   y = S C + D[h] x
Grouped B/C: head h reads group h // (H // G). The gated RMSNorm with z and the conv1d are the layer's, not here.

Two references, fp32 throughout (the CPU path, and what the GPU kernels are tested against; tests check both
against a float64 per-token oracle):
  - recurrent: token by token, the definition above (decode, verify, and the test oracle);
  - chunked (prefill): the SSD block form over chunks of chunk_size tokens that start at the sequence's first
    token: within a chunk, y_i = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j (a masked matmul) plus the
    state carried into the chunk, exp(cum_i) S C_i, with cum the running sum of dt A inside the chunk; the
    state passes from chunk to chunk as S <- exp(cum_last) S + sum_j exp(cum_last - cum_j) dt_j x_j B_j^T.
Both give the same numbers up to rounding; the chunk size changes nothing but the rounding.

States live in a pool ssm_states [num_slots, H, P, N] fp32 addressed by per-sequence slot indices (the layout HF
keeps for Mamba-2's ssm_state). Conventions are those of gated_delta.gated_delta_rule_varlen. The GPU path:
triton_mamba_ssd.py (decode update, verify, chunked scan).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.dispatch import use_triton
from lamina.kernels.metadata import StateMetadata
from lamina.kernels.slot_states import read_states, write_states

CHUNK_SIZE = 256


def ssd_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float = 0.0, dt_max: float = float("inf")) -> torch.Tensor:
    """The per-token step size in fp32: clamp(softplus(dt + dt_bias), dt_min, dt_max); dt [T, H] raw."""
    d = F.softplus(dt.float() + dt_bias.float())
    if dt_min > 0.0 or dt_max != float("inf"):
        d = d.clamp(dt_min, dt_max)
    return d


def _expand_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> fp32 [..., H, N] (head h reads group h // (H // G))."""
    g = t.shape[-2]
    t = t.float()
    return t if g == heads else t.repeat_interleave(heads // g, dim=-2)


def ssd_recurrent_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor, state: torch.Tensor,
                      keep_states: bool = False) -> tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]]:
    """Token by token over a batch of equal-length chunks: x [Bt, L, H, P]; dt [Bt, L, H] (already softplus'd and
    clamped, fp32); A [H] (negative); B, C [Bt, L, G, N]; D [H]; state [Bt, H, P, N].

    Returns (y [Bt, L, H, P] fp32, final state [Bt, H, P, N] fp32), or with keep_states the list of the L states
    after each token instead of the final one."""
    heads = x.shape[2]
    x, dt, A, D = x.float(), dt.float(), A.float(), D.float()
    B, C = _expand_groups(B, heads), _expand_groups(C, heads)
    s = state.float()
    ys, states = [], []
    for t in range(x.shape[1]):
        d = dt[:, t]  # [Bt, H]
        decay = torch.exp(d * A)[..., None, None]
        s = decay * s + (d[..., None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((s * C[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t])
        if keep_states:
            states.append(s)
    y = torch.stack(ys, dim=1) if ys else x.new_empty(x.shape)
    return y, (states if keep_states else s)


def ssd_chunked_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor, state: torch.Tensor,
                    chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in the SSD chunked form: x [L, H, P]; dt [L, H] (processed, fp32); A [H]; B, C [L, G, N];
    D [H]; state [H, P, N] (the state before the first token). Returns (y [L, H, P] fp32, final state fp32)."""
    length, heads, p = x.shape
    x, dt, A, D = x.float(), dt.float(), A.float(), D.float()
    B, C = _expand_groups(B, heads), _expand_groups(C, heads)
    pad = (chunk_size - length % chunk_size) % chunk_size
    # Padded tokens have dt = 0: decay exp(0) = 1 and no input, so they change neither state nor real outputs.
    x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    dt = F.pad(dt, (0, 0, 0, pad))
    nc = (length + pad) // chunk_size
    x, B, C = (t.reshape(nc, chunk_size, heads, t.shape[-1]) for t in (x, B, C))
    dt = dt.reshape(nc, chunk_size, heads)
    cum = torch.cumsum(dt * A, dim=1)  # [nc, L, H]: log of the decay from the chunk start through token i
    xdt = x * dt[..., None]
    # intra-chunk: masked (C_i . B_j) exp(cum_i - cum_j), masked before exp (cum_i - cum_j > 0 above the diagonal)
    seg = cum.transpose(1, 2)[..., :, None] - cum.transpose(1, 2)[..., None, :]  # [nc, H, i, j]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = seg.masked_fill(~causal, float("-inf")).exp()
    scores = torch.einsum("cihn,cjhn->chij", C, B) * decay
    y = torch.einsum("chij,cjhp->cihp", scores, xdt)
    # each chunk's own contribution to the state, from a zero state
    to_end = torch.exp(cum[:, -1:, :] - cum)  # [nc, L, H]
    chunk_states = torch.einsum("cjh,cjhp,cjhn->chpn", to_end, xdt, B)
    s = state.float()
    before = torch.empty(nc, heads, p, B.shape[-1], dtype=torch.float32, device=x.device)
    for c in range(nc):  # the only sequential part: pass the state across chunk boundaries
        before[c] = s
        s = torch.exp(cum[c, -1])[:, None, None] * s + chunk_states[c]
    y = y + torch.einsum("cih,chpn,cihn->cihp", cum.exp(), before, C)
    y = y.reshape(nc * chunk_size, heads, p)[:length] + D[:, None] * x.reshape(-1, heads, p)[:length]
    return y, s


def ssd_verify_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, state: torch.Tensor, ssm_states: torch.Tensor, candidates: list[int],
                   own_slot: int) -> torch.Tensor:
    """One sequence's verify chunk: x [L, H, P], dt [L, H] (processed), B, C [L, G, N], state [H, P, N] (before the
    chunk). Writes the state after token j into ssm_states[candidates[j]] for j < L - 1 (len(candidates) == L - 1)
    and after the last token into ssm_states[own_slot]; returns y [L, H, P] fp32."""
    length = x.shape[0]
    if len(candidates) != length - 1:
        raise ValueError(f"a verify chunk of {length} tokens needs {length - 1} candidate slots, got {len(candidates)}")
    y, states = ssd_recurrent_ref(x[None], dt[None], A, B[None], C[None], D, state[None], keep_states=True)
    for j, s in enumerate(states):
        ssm_states[candidates[j] if j < length - 1 else own_slot].copy_(s[0].to(ssm_states.dtype))
    return y[0]


def mamba_ssd_varlen_ref(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                         D: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor | None,
                         query_start: list[int], state_slots: list[int] | None, has_initial_state: list[bool],
                         dt_min: float = 0.0, dt_max: float = float("inf"), chunk_size: int = CHUNK_SIZE,
                         candidate_slots: list[list[int]] | None = None) -> torch.Tensor:
    """Flat varlen batch: x [T, H, P]; dt [T, H] raw; B, C [T, G, N] -> y [T, H, P] in x's dtype.

    One-token rows (decode) take one batched recurrent step; longer rows (prefill, a later chunk of a chunked
    prefill) the chunked form from the sequence's state; rows with candidate slots (verify) run token by token
    and leave the state after each token but the last in their candidates. States are read from
    ssm_states[slot] when has_initial_state (zeros otherwise) and written back there; ssm_states or state_slots
    None: zero states, nothing written."""
    n = len(query_start) - 1
    heads, p, nst = x.shape[1], x.shape[2], B.shape[2]
    if heads % B.shape[1] != 0 or C.shape != B.shape:
        raise ValueError(f"B/C {tuple(B.shape)}/{tuple(C.shape)} do not group {heads} heads")
    A = -A_log.float().exp()
    dtp = ssd_dt(dt, dt_bias, dt_min, dt_max)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    lens = [query_start[i + 1] - query_start[i] for i in range(n)]
    decode = [i for i in range(n) if lens[i] == 1]
    if decode:
        idx = torch.tensor([query_start[i] for i in decode], device=x.device)
        s = read_states(ssm_states, decode, state_slots, has_initial_state, (len(decode), heads, p, nst),
                        torch.float32, x.device)
        pick = lambda t: t.index_select(0, idx)[:, None]  # noqa: E731 -- [Bt, 1, ...]
        yd, s = ssd_recurrent_ref(pick(x), pick(dtp), A, pick(B), pick(C), D, s)
        y.index_copy_(0, idx, yd[:, 0])
        write_states(ssm_states, decode, state_slots, s)
    for i in (i for i in range(n) if lens[i] > 1):
        rows = slice(query_start[i], query_start[i + 1])
        s = read_states(ssm_states, [i], state_slots, has_initial_state, (1, heads, p, nst), torch.float32,
                        x.device)[0]
        cands = candidate_slots[i] if candidate_slots is not None and ssm_states is not None else []
        if cands and state_slots is not None:
            y[rows] = ssd_verify_ref(x[rows], dtp[rows], A, B[rows], C[rows], D, s, ssm_states, cands,
                                     state_slots[i])
            continue
        y[rows], s = ssd_chunked_ref(x[rows], dtp[rows], A, B[rows], C[rows], D, s, chunk_size)
        write_states(ssm_states, [i], state_slots, s[None])
    return y.to(x.dtype)


def mamba_ssd_varlen(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     D: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor | None,
                     attn: AttentionMetadata, state: StateMetadata | None, dt_min: float = 0.0,
                     dt_max: float = float("inf"), chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """The Mamba-2 layer's SSD over one step's flat batch (attn: its row layout; state: its slots).

    x [T, H, P]; dt [T, H] raw; A_log, D, dt_bias [H]; B, C [T, G, N]; ssm_states [num_slots, H, P, N] fp32.
    Returns y [T, H, P] in x's dtype (D x included, no z gate), the final states written to the slots (and, in a
    verify step, the state after every draft position to state.candidate_slots). The GPU path reads only device
    tensors (state.slots, state.has_initial_state, attn.query_start), so a decode step can be captured in a CUDA
    graph; the reference loops over the host lists. state None (a profiling pass): zero state, nothing written."""
    if state is None:
        ssm_states = None
    # Verify steps keep every intermediate state: the Triton verify kernel when the step holds only verify chunks
    # and single tokens (then state.candidate_slots is set); with prefill rows too, the verify kernel and the
    # chunked scan on the two halves of the batch.
    if use_triton(x) and state is not None and state.candidate_slots is not None and ssm_states is not None:
        from lamina.kernels.triton_mamba_ssd import mamba_ssd_verify_triton

        return mamba_ssd_verify_triton(x, dt, A_log, B, C, D, dt_bias, ssm_states, attn.query_start, state.slots,
                                       state.candidate_slots, state.has_initial_state, attn.max_query_len, dt_min,
                                       dt_max)
    if use_triton(x) and (state is None or state.candidate_slots_cpu is None):
        from lamina.kernels.triton_mamba_ssd import mamba_ssd_varlen_triton

        return mamba_ssd_varlen_triton(x, dt, A_log, B, C, D, dt_bias, ssm_states, attn, state, dt_min, dt_max,
                                       chunk_size)
    if use_triton(x) and ssm_states is not None:  # verify and prefill in one step (eager): split by sequence
        from lamina.kernels.triton_mamba_ssd import mamba_ssd_split_verify_triton

        return mamba_ssd_split_verify_triton(x, dt, A_log, B, C, D, dt_bias, ssm_states, attn, state, dt_min,
                                             dt_max)
    n = attn.num_seqs
    return mamba_ssd_varlen_ref(x, dt, A_log, B, C, D, dt_bias, ssm_states, attn.query_start_cpu,
                                state.slots_cpu if state is not None else None,
                                state.has_initial_state_cpu if state is not None else [False] * n,
                                dt_min, dt_max, chunk_size,
                                state.candidate_slots_cpu if state is not None else None)
