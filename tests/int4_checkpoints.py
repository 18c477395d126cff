"""Writers of 4-bit checkpoint tensors to the published format definitions (GPTQ v1, AWQ GEMM,
compressed-tensors pack-quantized through the compressed-tensors package's own packer), from integer
weights q, zero points z and scales s, plus the dense weight those define (the oracle). Written here from
the format descriptions, independently of lamina's unpacking."""
from __future__ import annotations

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def random_quant(n: int, k: int, group: int, seed: int, act_order: bool = False, sym: bool = False):
    """q [N, K] 0..15, z [N, K/G] (1..15; 8 if sym), s [N, K/G] fp16, g_idx [K]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    z = torch.full((n, k // group), 8) if sym else torch.randint(1, 16, (n, k // group), generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 0.002).half()
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return q, z, s, g_idx.int()


def dense_weight(q, z, s, g_idx) -> torch.Tensor:
    gi = g_idx.long()
    return s.float()[:, gi] * (q.float() - z.float()[:, gi])


def _pack8(vals: np.ndarray) -> np.ndarray:
    """[..., 8] values 0..15 -> int32 [...] with value j in bits 4j..4j+3."""
    out = np.zeros(vals.shape[:-1], dtype=np.uint32)
    for j in range(8):
        out |= (vals[..., j].astype(np.uint32) & 0xF) << (4 * j)
    return out.view(np.int32)


def gptq_tensors(q, z, s, g_idx, v1: bool = True) -> dict[str, torch.Tensor]:
    qt = q.t().numpy()  # [K, N]
    qweight = _pack8(qt.reshape(qt.shape[0] // 8, 8, -1).transpose(0, 2, 1))  # [K/8, N]
    zs = (z - 1 if v1 else z).t().numpy()  # [G, N]
    qzeros = _pack8(zs.reshape(zs.shape[0], -1, 8))  # [G, N/8]
    return {"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros),
            "scales": s.t().contiguous(), "g_idx": g_idx.int()}


def _awq_pack(vals: np.ndarray) -> np.ndarray:
    """[R, N] -> [R, N/8]: nibble j of int32 c holds column 8c + AWQ_ORDER[j]."""
    v = vals.reshape(vals.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    return _pack8(v)


def awq_tensors(q, z, s) -> dict[str, torch.Tensor]:
    return {"qweight": torch.from_numpy(_awq_pack(q.t().numpy())), "qzeros": torch.from_numpy(_awq_pack(z.t().numpy())),
            "scales": s.t().contiguous()}


def ct_tensors(q, z, s, g_idx=None, sym: bool = True) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: signed q - 8 packed by the package's pack_to_int32."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {"weight_packed": pack_to_int32((q - 8).to(torch.int8), 4),
           "weight_scale": s.float(),
           "weight_shape": torch.tensor(list(q.shape))}
    if not sym:
        out["weight_zero_point"] = pack_to_int32((z - 8).to(torch.int8), 4, packed_dim=0)
    if g_idx is not None:
        out["weight_g_idx"] = g_idx.int()
    return out
