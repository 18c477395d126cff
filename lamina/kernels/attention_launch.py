"""Which paged-attention kernels a step launches, decided on the host (no Triton import, so the engine can
build plans on any machine).

Eager steps derive the plan from the batch's host fields (query lengths). A CUDA graph must not: its kernels
are fixed when it is captured, so the graph runner passes a plan that depends only on its padded key, and
the kernels sort rows out on the device (a decode kernel program skips rows whose query length is not 1, the
prefill kernel skips query-length-1 rows when the decode kernel runs too, and sequences with seq_len 0 are
padding: their rows get zeros and no K/V is read).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionLaunch:
    decode: bool  # launch the split-K decode kernel (rows with query length 1)
    prefill: bool  # launch the varlen prefill kernel (rows with query length > 1; all rows if not decode)
    # Device int32 [1]: how many of the batch's sequences are in use (graph padding follows them). Lets the
    # prefill kernel's spare programs exit before their binary search; None: all sequences are in use.
    num_seqs: torch.Tensor | None = None


def launch_from_host(meta) -> AttentionLaunch:
    """The plan of an eager step, from its host-side query lengths (AttentionMetadata fields)."""
    if meta.is_decode_only:
        return AttentionLaunch(True, False)
    qs = meta.query_start_cpu
    has_decode = any(qs[i + 1] - qs[i] == 1 for i in range(meta.num_seqs))
    return AttentionLaunch(has_decode, meta.max_query_len > 1)


def launch_of(meta) -> AttentionLaunch:
    """A plan the metadata carries (graph runner: fixed per key) or the one its host fields imply."""
    plan = getattr(meta, "launch", None)
    return plan if plan is not None else launch_from_host(meta)
