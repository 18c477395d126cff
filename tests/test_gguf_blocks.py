"""GGUF block unpacking against the gguf package's own dequantization: random bytes for every block type
(every bit pattern of the quants and packed sub-scales, with sane fp16 super-scales), and real quantized
data where gguf can quantize (Q8_0, Q4_0, Q4_1)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from lamina.kernels.wq_matmul import dequantize
from lamina.models.weight_formats.gguf_blocks import BLOCKS, SUPPORTED, pack_rows, row_bytes, unpack

# byte offsets of the fp16 super-scales in each block (random bytes there could be inf/nan)
_F16_AT = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _random_blocks(qtype, rows: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    per, size, _ = BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(rows, k // per, size), dtype=np.uint8)
    for at in _F16_AT[qtype]:
        raw[..., at:at + 2] = rng.uniform(-0.05, 0.05, (rows, k // per, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_unpack_matches_gguf_dequantize(qtype):
    rows, k = 6, 512
    raw = _random_blocks(qtype, rows, k, seed=int(qtype))
    ref = gguf_dequantize(raw, qtype).reshape(rows, k)
    u = unpack(torch.from_numpy(raw), qtype, k)
    w = u.q * np.repeat(u.scale, u.group, 1) + np.repeat(u.offset, u.group, 1)
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_packed_layout_matches_gguf_dequantize(qtype):
    """After repacking into the matmul layout (fp16 scales/offsets), dequantize() is gguf's within fp16."""
    rows, k = 5, 256
    raw = _random_blocks(qtype, rows, k, seed=100 + int(qtype))
    ref = gguf_dequantize(raw, qtype).reshape(rows, k)
    bits = 4 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 8
    qweight, scales, offsets = pack_rows(torch.from_numpy(raw), qtype, k, bits, BLOCKS[qtype][2])
    w = dequantize(qweight, scales, offsets, bits).numpy()
    step = np.abs(ref).max()
    np.testing.assert_allclose(w, ref, atol=step * 2e-3)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_unpack_real_quantized_data(qtype):
    rows, k = 8, 256
    x = np.random.default_rng(0).standard_normal((rows, k)).astype(np.float32) * 0.05
    raw = gguf_quantize(x, qtype)
    assert raw.shape == (rows, row_bytes(qtype, k))
    u = unpack(torch.from_numpy(raw), qtype, k)
    w = u.q * np.repeat(u.scale, u.group, 1) + np.repeat(u.offset, u.group, 1)
    np.testing.assert_allclose(w, gguf_dequantize(raw, qtype).reshape(rows, k), rtol=1e-6, atol=1e-7)


def test_bad_shapes_and_types_are_refused():
    with pytest.raises(ValueError, match="needs uint8"):
        unpack(torch.zeros(2, 30, dtype=torch.uint8), T.Q8_0, 32)
    with pytest.raises(ValueError, match="not a whole number"):
        row_bytes(T.Q4_K, 100)
    with pytest.raises(ValueError, match="Q5_0 is not kept quantized.*Q4_K"):
        unpack(torch.zeros(2, 22, dtype=torch.uint8), T.Q5_0, 32)
