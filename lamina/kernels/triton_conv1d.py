"""Triton causal depthwise conv1d over a varlen batch, with per-sequence rolling states in a slot pool.

Contract: lamina.kernels.conv1d.causal_conv1d_varlen_ref (device tensors instead of python lists). x [T, C]
(rows may be strided: a split of the input projection), weight [C, K]; sequence b owns rows
query_start[b]..query_start[b+1] and convolves over (state | chunk), state = conv_states[slot] [C, K-1]
(oldest first; zeros where has_initial_state[b] is False, and that slot is then never read).

Design
- One kernel for prefill, chunked prefill, decode and mixed batches. Decode (max_query_len 1): grid
  (B, 1, cdiv(C, BLOCK_C)), one program per sequence. Otherwise the token blocks are numbered across the
  batch, sequence b's from query_start[b] // BLOCK_T + b, grid (T // BLOCK_T + B, 1, cdiv(C, BLOCK_C)), and
  a program finds its sequence by binary search over query_start; block numbers past a sequence's last
  block (and empty sequences) exit. Grids come from shapes and BLOCK_T, lengths, slots and flags are read
  on the device: CUDA-graph safe, and a graph's padded batch (T_pad rows, S slots) launches about
  T_pad / 32 + S programs per channel block. The only per-batch int argument, B, is not specialised on.
  Chunks of at most K-1 tokens (decode rows of a mixed batch) skip the main tile at run time.
- A program computes a [BLOCK_T, BLOCK_C] output tile in fp32 as K shifted (row-offset) loads of x times
  a weight column; the shifted loads overlap and mostly hit L1/L2, so DRAM sees about (1 + (K-1)/BLOCK_T)
  reads of x. Output rows 0..K-2 of a chunk reach back into the old state: when a state may be read,
  the first token block (t0 = 0) computes them as a separate [min(K-1, BLOCK_T) (pow2), BLOCK_C] head
  tile that gathers from the state, and the main tile skips them (and is skipped outright when the head
  covers the whole block, as in decode), so no other tile issues state gathers.
- Race: the first token block is also the only writer of the new state (the last K-1 columns of
  (state | chunk): x's last K-1 rows of the chunk, plus old state columns when the chunk is shorter than
  K-1). BLOCK_T >= K-1 whenever a sequence spans several token blocks, so no other program reads the
  old state; inside the program a barrier separates every read of the old state from the write (threads
  of other warps may hold replicas of the same state elements).
- Tiles (4 warps): BLOCK_T = next_pow2(max_query_len) capped at 32; BLOCK_C = 512 for decode batches
  (BLOCK_T = 1), 256 up to BLOCK_T = 16, 128 at 32. ptxas -v for sm_90, bf16, C = 8192, K = 4, compiled on
  the CPU with the runtime's 16-divisibility attrs: 72 / 48-78 / 76 registers, no spills; the main tile's
  x loads and out stores are 16-byte (LDG.E.128 / STG.E.128); state gathers are 2-byte (rows of K-1).
- fp32 math throughout (the reference rounds to the weight dtype in between; not reproduced).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_seqs"])
def _conv1d_varlen_kernel(x_ptr, w_ptr, bias_ptr, state_ptr, qs_ptr, slot_ptr, init_ptr, out_ptr,
                          C, num_seqs, stride_x, stride_o, stride_wc, stride_wk, stride_ss, stride_sc, stride_sk,
                          K: tl.constexpr, KP: tl.constexpr, HP: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr,
                          HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_INIT: tl.constexpr,
                          SKIP_MAIN: tl.constexpr, SILU: tl.constexpr, TILED: tl.constexpr):
    if TILED:
        # Sequence b's token blocks are numbered from query_start[b] // BLOCK_T + b (monotone in b, at most
        # T // BLOCK_T + B in all, so the grid comes from shapes): a binary search finds b.
        tile = tl.program_id(0)
        lo: tl.int32 = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(qs_ptr + mid) // BLOCK_T + mid <= tile:
                lo = mid + 1
            else:
                hi = mid
        b = lo - 1
        start = tl.load(qs_ptr + b)
        pid_t = tile - (start // BLOCK_T + b)
    else:
        b = tl.program_id(0)
        pid_t = tl.program_id(1)
        start = tl.load(qs_ptr + b)
    length = tl.load(qs_ptr + b + 1) - start
    t0 = pid_t * BLOCK_T
    if t0 >= length:  # past this sequence's chunk (or an empty row of a padded batch)
        return
    start = start.to(tl.int64)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    rows = t0 + tl.arange(0, BLOCK_T)  # positions in the chunk
    live = False
    s_base = state_ptr
    if HAS_STATE:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        s_base = state_ptr + slot * stride_ss
        if HAS_INIT:
            live = tl.load(init_ptr + b) != 0

    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], tl.float32)
    # Rows 0..K-2 of a chunk reach back into the old state. With a state to read they are computed by the
    # first token block as a separate small head tile, so the main tile never gathers from the state (and
    # is skipped outright when the head covers the only token block, e.g. decode).
    if HAS_INIT:  # noqa: SIM102 -- a compile-time branch around a run-time one
        if pid_t == 0:
            r = tl.arange(0, HP)  # HP = min(KP, BLOCK_T): rows past BLOCK_T exist only in longer batches
            head = tl.zeros([HP, BLOCK_C], tl.float32) + bias[None, :]
            for j in tl.static_range(K):
                w = tl.load(w_ptr + cols * stride_wc + j * stride_wk, mask=cmask, other=0.0).to(tl.float32)
                p = r + (j - (K - 1))
                mx = ((p >= 0) & (p < length))[:, None] & cmask[None, :]
                xv = tl.load(x_ptr + (start + p)[:, None] * stride_x + cols[None, :], mask=mx, other=0.0)
                ms = (p < 0)[:, None] & cmask[None, :] & live
                sv = tl.load(s_base + cols[None, :] * stride_sc + (p + (K - 1))[:, None] * stride_sk, mask=ms,
                             other=0.0)
                head += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
            if SILU:
                head = head / (1.0 + tl.exp(-head))
            hm = ((r < K - 1) & (r < length))[:, None] & cmask[None, :]
            tl.store(out_ptr + (start + r)[:, None] * stride_o + cols[None, :], head.to(out_ptr.dtype.element_ty),
                     mask=hm)
    # A chunk of at most K-1 tokens is all head tile (decode rows of a mixed batch): no main tile.
    if not SKIP_MAIN:
        main = (pid_t > 0) | (length > K - 1) | (not HAS_INIT)
    else:
        main = False
    if main:
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32) + bias[None, :]
        for j in tl.static_range(K):
            w = tl.load(w_ptr + cols * stride_wc + j * stride_wk, mask=cmask, other=0.0).to(tl.float32)
            p = rows + (j - (K - 1))  # chunk position feeding output row `rows` through tap j
            m = ((p >= 0) & (p < length))[:, None] & cmask[None, :]
            xv = tl.load(x_ptr + (start + p)[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
            acc += xv.to(tl.float32) * w[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        om = rows < length
        if HAS_INIT:
            om = om & (rows >= K - 1)  # the head tile wrote those
        tl.store(out_ptr + (start + rows)[:, None] * stride_o + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=om[:, None] & cmask[None, :])

    if HAS_STATE:  # noqa: SIM102 -- a compile-time branch around a run-time one
        if pid_t == 0:  # the single writer of this sequence's new state (per channel block)
            i = tl.arange(0, KP)
            im = i < K - 1
            qpos = length - (K - 1) + i  # chunk position of new-state column i (< 0: old state column)
            from_x = (qpos >= 0) & im
            new = tl.load(x_ptr + (start + qpos)[None, :] * stride_x + cols[:, None],
                          mask=cmask[:, None] & from_x[None, :], other=0.0).to(state_ptr.dtype.element_ty)
            if HAS_INIT:
                from_s = (qpos < 0) & im & live
                old = tl.load(s_base + cols[:, None] * stride_sc + (length + i)[None, :] * stride_sk,
                              mask=cmask[:, None] & from_s[None, :], other=0.0)
                new = tl.where(from_x[None, :], new, old)
            tl.debug_barrier()  # every read of the old state (any warp) before the first write
            tl.store(s_base + cols[:, None] * stride_sc + i[None, :] * stride_sk, new,
                     mask=cmask[:, None] & im[None, :])


def conv1d_tiles(max_query_len: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_C, num_warps) for a batch whose longest chunk is max_query_len tokens."""
    block_t = min(32, triton.next_power_of_2(max(1, max_query_len)))
    if max_query_len > block_t:  # several token blocks: the first must cover every read of the old state
        block_t = max(block_t, triton.next_power_of_2(k - 1))
    # ptxas -v (sm_90, bf16, C=8192, K=4): 1x512 72 regs, 2..16 x 256 48-78, 32x128 76, none spill;
    # 4x512 and 8x512 reach 148-155 and 4x1024 spills (the head and new-state tiles are [<=4, BLOCK_C]).
    block_c = 512 if block_t == 1 else (256 if block_t <= 16 else 128)
    return block_t, block_c, 4


def causal_conv1d_varlen_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                conv_states: torch.Tensor | None, query_start: torch.Tensor,
                                state_slots: torch.Tensor | None, has_initial_state: torch.Tensor | None,
                                max_query_len: int, activation: str | None = "silu", *,
                                out: torch.Tensor | None = None, block_t: int | None = None,
                                block_c: int | None = None) -> torch.Tensor:
    """x [T, C] -> act(conv) [T, C] (contiguous, x's dtype); conv_states[slot] updated in place.

    query_start [B+1] int32, state_slots [B] int (device). has_initial_state [B] bool (device); None means
    every sequence starts fresh. conv_states or state_slots None: zero states, nothing written.
    block_t / block_c override the tiles (tests, sweeps); block_t must be >= K-1 when a chunk is longer
    than it.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, c = x.shape
    k = weight.shape[-1]
    assert weight.shape[0] == c and k >= 2
    if out is None:
        out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    assert out.shape == (t, c) and out.stride(-1) == 1
    b = query_start.shape[0] - 1
    if t == 0 or b <= 0 or max_query_len <= 0:
        return out
    bt, bc, warps = conv1d_tiles(max_query_len, k)
    bt, bc = block_t or bt, block_c or bc
    assert max_query_len <= bt or bt >= k - 1, "the first token block must own every read of the old state"
    has_state = conv_states is not None and state_slots is not None
    has_init = has_state and has_initial_state is not None
    if has_state:
        assert conv_states.shape[1:] == (c, k - 1)
        state, slots = conv_states, state_slots
        ss = conv_states.stride()
    else:
        state, slots, ss = x, query_start, (0, 0, 0)
    if has_init:
        assert has_initial_state.shape == (b,) and has_initial_state.stride(0) == 1
        init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    else:
        init = query_start
    assert query_start.stride(0) == 1 and (not has_state or state_slots.stride(0) == 1)
    # One token per sequence (decode): one program per sequence. Longer chunks: token blocks numbered across
    # the batch (grid from T and B only, so a CUDA graph's padded batch launches T_pad // BLOCK_T + S programs,
    # not S * T_pad / BLOCK_T of which all but a few would exit).
    tiled = max_query_len > 1
    grid = (t // bt + b, 1, triton.cdiv(c, bc)) if tiled else (b, 1, triton.cdiv(c, bc))
    kp = triton.next_power_of_2(k - 1)
    _conv1d_varlen_kernel[grid](
        x, weight, bias if bias is not None else weight, state, query_start, slots, init, out,
        c, b, x.stride(0), out.stride(0), weight.stride(0), weight.stride(1), ss[0], ss[1], ss[2],
        K=k, KP=kp, HP=min(kp, bt), BLOCK_T=bt, BLOCK_C=bc, HAS_BIAS=bias is not None,
        HAS_STATE=has_state, HAS_INIT=has_init, SKIP_MAIN=has_init and bt <= k - 1 and not tiled,
        SILU=activation is not None, TILED=tiled, num_warps=warps)
    return out
