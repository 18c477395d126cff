"""The grouped gated RMSNorm kernel (the Mamba-2 mixer's output norm) against its torch reference on fresh
random inputs: groups within one tile, non-power-of-two groups, groups walked in several tiles, a gate that is
a strided view of the in_proj output (as the layer passes it), every dtype. The output starts NaN-poisoned
(torch.empty is replaced), so an unwritten element fails."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, TOL, rel_err

from lamina.kernels.norm_gated_grouped import grouped_gated_rms_norm, grouped_gated_rms_norm_ref

# name: (rows, width, group size, tile override)
CASES = {
    "nemotron_like": (7, 64, 16, None),
    "one_group": (3, 96, 96, None),  # Bamba: n_groups 1, a non-power-of-two group
    "multi_tile": (4, 600, 300, 64),  # walked in 5 tiles, the last one masked
    "decode_row": (1, 128, 32, 32),
}
PARAMS = [(c, d) for c in CASES for d in (torch.float32, torch.bfloat16)] + [("nemotron_like", torch.float16)]


@pytest.mark.parametrize("case,dtype", PARAMS, ids=[f"{c}-{str(d)[6:]}" for c, d in PARAMS])
def test_grouped_gated_norm_kernel(case, dtype, monkeypatch):
    from lamina.kernels import triton_norm_gated_grouped as mod

    t, width, group, block = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    y = torch.randn(t, width, generator=gen).to(dtype)
    proj = torch.randn(t, 2 * width + 5, generator=gen).to(dtype)  # z is a strided slice of a wider projection
    z = proj[:, 3:3 + width]
    w = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    ref = grouped_gated_rms_norm_ref(y, z, w, group, 1e-5)
    real_empty = torch.empty
    monkeypatch.setattr(mod.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    out = mod.grouped_gated_rms_norm_triton(y.to(DEV), z.to(DEV), w.to(DEV), group, 1e-5, block=block)
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-6)


def test_dispatch_on_this_device():
    gen = torch.Generator().manual_seed(1)
    y, z, w = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen), torch.rand(48, generator=gen)
    ref = grouped_gated_rms_norm_ref(y, z, w, 12, 1e-5)
    assert rel_err(grouped_gated_rms_norm(y.to(DEV), z.to(DEV), w.to(DEV), 12, 1e-5), ref) < TOL[torch.float32]
