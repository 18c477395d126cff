"""The gated delta rule (Gated DeltaNet's linear-attention core), with a recurrent state per sequence.

Per value head, with S the [dk, dv] state, a token (q, k, v, decay g <= 0 in log space, rate beta):
    S <- exp(g) * S;  S <- S + k (beta * (v - S^T k))^T;  out = S^T q
q and k are L2-normalized and q is scaled by dk^-0.5 first (Qwen3-Next / Qwen3.5 do it "in kernel").

Two references, both fp32 like HF's torch fallbacks (the oracle in tests):
  - chunked (prefill): the UT-transform form over chunks of 64 tokens, as HF and fla compute it;
  - recurrent (decode): one token at a time.
Grouped heads: value head h reads query/key head h // (Hv // Hk).

States live in a pool tensor ssm_states [num_slots, Hv, dk, dv] addressed by per-sequence slot indices.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.dispatch import use_triton
from lamina.kernels.gdn_gates import gdn_gates
from lamina.kernels.metadata import StateMetadata
from lamina.kernels.slot_states import read_states, write_states

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # rsqrt(sum + eps), not F.normalize: the form fla and HF use, so results match to the last bits.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """[B, L, H, D] inputs -> fp32 [B, Hv, L, D] with grouped q/k heads expanded and q scaled."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = (t.transpose(1, 2).to(torch.float32).contiguous() for t in (q, k, v, beta, g))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor, chunk_size: int = CHUNK_SIZE,
                               use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, L, Hk, dk]; v: [B, L, Hv, dv]; g, beta: [B, L, Hv]; initial_state: [B, Hv, dk, dv].

    Returns (out [B, L, Hv, dv] in q's dtype, final state [B, Hv, dk, dv] fp32).
    """
    out_dtype, length = q.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    b, h, _, dk = k.shape
    dv = v.shape[-1]
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    n_chunks = (length + pad) // chunk_size
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(b, h, n_chunks, chunk_size, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, n_chunks, chunk_size).cumsum(-1)  # log of the decay from the chunk start to each token
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [.., i, j]: j -> i
    # UT transform: (I + strictly-lower(beta k k^T * decay)) solves all of a chunk's delta updates at once.
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    state = initial_state.to(torch.float32)
    out = torch.empty(b, h, n_chunks, chunk_size, dv, dtype=torch.float32, device=q.device)
    for i in range(n_chunks):
        v_new = new_v[:, :, i] - k_cumdecay[:, :, i] @ state  # the part the old state does not already predict
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(b, h, -1, dv)[:, :, :length]
    return out.transpose(1, 2).to(out_dtype).contiguous(), state


def recurrent_gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, initial_state: torch.Tensor,
                                   use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as chunk_gated_delta_rule_ref, token by token (decode: L == 1)."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    state = initial_state.to(torch.float32)
    out = torch.empty_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k[:, :, t, :, None]).sum(dim=-2)
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    return out.transpose(1, 2).to(out_dtype).contiguous(), state


def recurrent_verify_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, ssm_states: torch.Tensor, candidates: list[int], own_slot: int,
                         use_qk_l2norm: bool = True) -> torch.Tensor:
    """One sequence's chunk: q, k [L, Hk, dk]; v [L, Hv, dv]; g, beta [L, Hv]; state [1, Hv, dk, dv] (its
    state before the chunk). Writes the state after token j into ssm_states[candidates[j]] for j < L - 1
    (len(candidates) == L - 1) and after the last token into ssm_states[own_slot]; returns out [L, Hv, dv]."""
    length = q.shape[0]
    if len(candidates) != length - 1:
        raise ValueError(f"a verify chunk of {length} tokens needs {length - 1} candidate slots, got {len(candidates)}")
    outs = []
    for t in range(length):
        o, state = recurrent_gated_delta_rule_ref(q[None, t:t + 1], k[None, t:t + 1], v[None, t:t + 1],
                                                  g[None, t:t + 1], beta[None, t:t + 1], state, use_qk_l2norm)
        outs.append(o[0])
        slot = candidates[t] if t < length - 1 else own_slot
        ssm_states[slot].copy_(state[0].to(ssm_states.dtype))
    return torch.cat(outs, dim=0)


def gated_delta_rule_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, ssm_states: torch.Tensor | None, query_start: list[int],
                                state_slots: list[int] | None, has_initial_state: list[bool],
                                use_qk_l2norm: bool = True,
                                candidate_slots: list[list[int]] | None = None) -> torch.Tensor:
    """Flat varlen batch: q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv] -> out [T, Hv, dv].

    Single-token rows (decode) take one batched recurrent step; each longer chunk (prefill, possibly a later
    chunk of a chunked prefill) runs the chunked form from the sequence's state. States are read from and
    written back to ssm_states[slot]; None: zero state, nothing written. candidate_slots (verify steps): a
    sequence with candidates runs token by token and leaves its state after its chunk's token j in
    ssm_states[candidate_slots[i][j]] (every token but the last), so a rejected draft can be rolled back.
    """
    n = len(query_start) - 1
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    out = torch.empty_like(v)
    lens = [query_start[i + 1] - query_start[i] for i in range(n)]
    decode = [i for i in range(n) if lens[i] == 1]
    if decode:
        idx = torch.tensor([query_start[i] for i in decode], device=q.device)
        state = read_states(ssm_states, decode, state_slots, has_initial_state, (len(decode), hv, dk, dv),
                            torch.float32, q.device)
        pick = lambda t: t.index_select(0, idx)[:, None]  # noqa: E731 -- [B, 1, ...]
        o, state = recurrent_gated_delta_rule_ref(pick(q), pick(k), pick(v), pick(g), pick(beta), state,
                                                  use_qk_l2norm)
        out.index_copy_(0, idx, o[:, 0])
        write_states(ssm_states, decode, state_slots, state)
    for i in (i for i in range(n) if lens[i] > 1):
        rows = slice(query_start[i], query_start[i + 1])
        state = read_states(ssm_states, [i], state_slots, has_initial_state, (1, hv, dk, dv), torch.float32,
                            q.device)
        cands = candidate_slots[i] if candidate_slots is not None and ssm_states is not None else []
        if cands:
            out[rows] = recurrent_verify_ref(q[rows], k[rows], v[rows], g[rows], beta[rows], state, ssm_states,
                                             cands, state_slots[i], use_qk_l2norm)
            continue
        o, state = chunk_gated_delta_rule_ref(q[None, rows], k[None, rows], v[None, rows], g[None, rows],
                                              beta[None, rows], state, CHUNK_SIZE, use_qk_l2norm)
        out[rows] = o[0]
        write_states(ssm_states, [i], state_slots, state)
    return out


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                            A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor | None,
                            attn: AttentionMetadata, state: StateMetadata | None,
                            use_qk_l2norm: bool = True) -> torch.Tensor:
    """The layer's gated delta rule over one step's flat batch (attn: its row layout; state: its slots).

    The GPU path reads only device tensors (state.slots, state.has_initial_state, attn.query_start), so a
    decode step can be captured in a CUDA graph; the reference loops over the host lists. state None (a
    profiling pass): zero state, nothing written."""
    if state is None:
        ssm_states = None
    # Verify steps keep every intermediate state: the Triton verify kernel when the step holds only verify
    # chunks and single tokens (a decode batch with drafts), else the reference.
    if use_triton(q) and state is not None and state.candidate_slots is not None and ssm_states is not None:
        from lamina.kernels.triton_gdn_verify import gated_delta_verify_triton

        return gated_delta_verify_triton(q, k, v, a, b, A_log, dt_bias, ssm_states, attn.query_start, state.slots,
                                         state.candidate_slots, state.has_initial_state, attn.max_query_len,
                                         use_qk_l2norm)
    if use_triton(q) and (state is None or state.candidate_slots_cpu is None):
        from lamina.kernels.triton_gated_delta import gated_delta_rule_varlen_triton

        return gated_delta_rule_varlen_triton(q, k, v, a, b, A_log, dt_bias, ssm_states, attn, state, use_qk_l2norm)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    n = attn.num_seqs
    return gated_delta_rule_varlen_ref(q, k, v, g, beta, ssm_states, attn.query_start_cpu,
                                       state.slots_cpu if state is not None else None,
                                       state.has_initial_state_cpu if state is not None else [False] * n,
                                       use_qk_l2norm, state.candidate_slots_cpu if state is not None else None)
