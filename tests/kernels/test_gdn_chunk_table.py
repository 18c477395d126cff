"""The device-built chunk table of the chunked gated delta rule against the host builder (exact), on random
batches with decode rows, chunk-boundary lengths, empty sequences and graph-style padding (a padding sequence
owning the tail rows, empty slots after it)."""
from __future__ import annotations

import random

import pytest
import torch
from kernel_helpers import DEV


def _starts(lens):
    qs = [0]
    for n in lens:
        qs.append(qs[-1] + n)
    return qs


def _check(lens):
    from lamina.kernels.triton_gdn_chunk_table import chunk_table_device, chunk_table_host, num_chunks

    qs = _starts(lens)
    want, nc = chunk_table_host(qs, qs[-1])
    got, nc_dev = chunk_table_device(torch.tensor(qs, dtype=torch.int32, device=DEV), qs[-1])
    assert nc_dev == nc == num_chunks(qs[-1], len(lens))
    assert got.cpu().tolist() == want, lens
    # every real chunk appears exactly once, in order, and covers its sequence
    starts, ends = want[:nc], want[nc:2 * nc]
    chunks = [(s, e) for s, e in zip(starts, ends) if e > s]
    assert chunks == sorted(chunks) and sum(e - s for s, e in chunks) == qs[-1]
    assert len(chunks) == sum(-(-n // 64) for n in lens)


@pytest.mark.parametrize("seed", range(6))
def test_device_table_equals_host_on_random_batches(seed):
    rng = random.Random(seed)
    for _ in range(4):
        b = rng.randint(1, 70)
        lens = [rng.choice([0, 1, 1, 1, 2, 63, 64, 65, 128, rng.randint(1, 400)]) for _ in range(b)]
        if not sum(lens):
            lens[0] = 1
        _check(lens)


def test_graph_padded_batches():
    # what graph_inputs.py builds: the step's sequences, one padding sequence up to T_pad, empty slots after
    for lens, t_pad, slots in [([1] * 40 + [512], 576, 65), ([700], 704, 65), ([1, 1, 1], 16, 16),
                               ([64, 64], 128, 65), ([5], 16, 2)]:
        tail = t_pad - sum(lens)
        _check(lens + [tail] + [0] * (slots - len(lens) - 1))


def test_single_sequence_and_decode_rows():
    _check([1])
    _check([1] * 129)
    _check([8192])
