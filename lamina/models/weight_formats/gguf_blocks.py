"""GGUF block types -> the grouped-integer layout of kernels/wq_matmul.py, without dequantizing.

Each supported type is a row of fixed-size blocks along K; every block stores small integers and the
numbers that turn them into weights. Unpacking a row gives q [rows, K], and per group of `group` elements
a scale and an offset with W = q * scale + offset, exactly the GGUF formula (llama.cpp's ggml-quants):

| type | block | group | bits | weight |
|---|---|---|---|---|
| Q8_0 | 32 (34 B) | 32 | 8 | d * q, q int8 |
| Q4_0 | 32 (18 B) | 32 | 4 | d * (q - 8) |
| Q4_1 | 32 (20 B) | 32 | 4 | d * q + m |
| Q4_K | 256 (144 B) | 32 | 4 | d * sc_j * q - dmin * m_j (6-bit sc/m per 32) |
| Q5_K | 256 (176 B) | 32 | 5 -> 8 | as Q4_K, a fifth bit from qh |
| Q6_K | 256 (210 B) | 16 | 6 -> 8 | d * sc_j * (q - 32), int8 sc per 16 |

Q5_K and Q6_K have no 5/6-bit kernel here: they unpack to 8-bit integers (9 bits per weight with the
scales, against their 5.5 / 6.6), a repacking that keeps every value. Tested against gguf.quants.dequantize.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

Q4_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)
Q8_TYPES = (T.Q8_0, T.Q5_K, T.Q6_K)
SUPPORTED = Q4_TYPES + Q8_TYPES
# type -> (elements per block, bytes per block, group of the unpacked layout)
BLOCKS = {T.Q8_0: (32, 34, 32), T.Q4_0: (32, 18, 32), T.Q4_1: (32, 20, 32), T.Q4_K: (256, 144, 32),
          T.Q5_K: (256, 176, 32), T.Q6_K: (256, 210, 16)}


def supported_names() -> str:
    return ", ".join(t.name for t in SUPPORTED)


@dataclass
class Unpacked:
    """q [rows, K] (uint8 / int8 / int16: the integer each weight is), scale and offset [rows, K / group] (fp32); numpy
    arrays (torch's uint8 arithmetic is an order of magnitude slower on the CPU, and this runs at load)."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    group: int


def row_bytes(qtype: T, k: int) -> int:
    per, size, _ = BLOCKS[qtype]
    if k % per:
        raise ValueError(f"a {qtype.name} row of {k} elements is not a whole number of {per}-element blocks")
    return k // per * size


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block [rows, nb, bytes] -> fp32 [rows, nb, 1]."""
    return np.ascontiguousarray(b[..., at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[..., j * run bytes] -> [..., 2 j run]: per run of bytes, the low nibbles, then the high ones."""
    qs = qs.reshape(*qs.shape[:-1], -1, run)
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(*qs.shape[:-2], -1)


def _k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins [..., 8]."""
    sc = sc.astype(np.int32)
    lo_s, lo_m = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    hi_s = (sc[..., 8:12] & 0xF) | ((sc[..., 0:4] >> 6) << 4)
    hi_m = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return (np.concatenate([lo_s, hi_s], -1).astype(np.float32),
            np.concatenate([lo_m, hi_m], -1).astype(np.float32))


def unpack(raw: torch.Tensor | np.ndarray, qtype: T, k: int) -> Unpacked:
    """raw: uint8 [rows, row_bytes(qtype, k)] (the GGUF tensor's bytes, one row per output feature)."""
    if qtype not in BLOCKS:
        raise ValueError(f"GGUF type {qtype.name} is not kept quantized (supported: {supported_names()})")
    per, size, group = BLOCKS[qtype]
    raw = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"a {qtype.name} tensor with rows of {k} elements needs uint8 [rows, "
                         f"{row_bytes(qtype, k)}] bytes, got {raw.dtype} {tuple(raw.shape)}")
    rows = raw.shape[0]
    b = raw.reshape(rows, k // per, size)
    if qtype == T.Q8_0:
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8)
        d = _f16(b, 0)
        scale, offset = d, np.zeros_like(d)
    elif qtype in (T.Q4_0, T.Q4_1):
        start = 2 if qtype == T.Q4_0 else 4
        q = _nibbles(b[..., start:], 16)
        d = _f16(b, 0)
        scale, offset = d, (-8 * d if qtype == T.Q4_0 else _f16(b, 2))
    elif qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scales(b[..., 4:16])
        if qtype == T.Q4_K:
            q = _nibbles(b[..., 16:], 32)
        else:
            qh = b[..., 16:48].astype(np.int16)  # bit j of qh[l]: the fifth bit of element 32 j + l
            high = np.concatenate([(qh >> j) & 1 for j in range(8)], axis=-1) << 4
            q = _nibbles(b[..., 48:], 32).astype(np.int16) | high
        scale, offset = d * sc, -dmin * mn
    else:  # Q6_K: ql[128] qh[64] scales[16] d; two halves of 128 elements
        ql, qh = b[..., 0:128].astype(np.int16), b[..., 128:192].astype(np.int16)
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
        d = _f16(b, 208)
        halves = []
        for h in range(2):
            lo, hb = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
            halves += [(lo[..., 0:32] & 0xF) | ((hb & 3) << 4), (lo[..., 32:64] & 0xF) | (((hb >> 2) & 3) << 4),
                       (lo[..., 0:32] >> 4) | (((hb >> 4) & 3) << 4), (lo[..., 32:64] >> 4) | (((hb >> 6) & 3) << 4)]
        q = np.concatenate(halves, axis=-1) - 32
        # Groups of 16 in element order: scale j covers elements 16 j .. 16 j + 15.
        scale, offset = d * sc, np.zeros_like(sc)
    return Unpacked(q.reshape(rows, k), scale.reshape(rows, -1), offset.reshape(rows, -1), group)


def pack_rows(raw: torch.Tensor, qtype: T, k: int, bits: int, group: int) -> tuple[torch.Tensor, ...]:
    """GGUF rows -> (qweight, scales, offsets) of the wq_matmul layout with `bits` and `group` (a layer
    whose fused parts have different types uses the widest bits and the smallest group among them)."""
    u = unpack(raw, qtype, k)
    if bits == 4 and qtype not in Q4_TYPES:
        raise ValueError(f"a {qtype.name} tensor does not fit 4 bits")
    if u.group % group:
        raise ValueError(f"a {qtype.name} tensor (groups of {u.group}) cannot use groups of {group}")
    rep = u.group // group
    scales = torch.from_numpy(np.repeat(u.scale, rep, axis=1).astype(np.float16))
    offsets = torch.from_numpy(np.repeat(u.offset, rep, axis=1).astype(np.float16))
    if bits == 4:
        q = u.q.astype(np.uint8, copy=False).reshape(u.q.shape[0], -1, 2)
        qweight = torch.from_numpy(np.ascontiguousarray(q[..., 0] | (q[..., 1] << 4)))
    else:
        qweight = torch.from_numpy(u.q.astype(np.int8, copy=False))
    return qweight, scales, offsets
