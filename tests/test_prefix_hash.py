"""Prefix-cache block keys: a SHA-256 chain over (parent digest, extra key, token ids), stable across processes
and distinct wherever the KV could differ."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from array import array

from lamina.cache.prefix_cache import ROOT, chain_hash

BLOCK = list(range(1000, 1016))


def oracle(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    return hashlib.sha256(parent + len(extra).to_bytes(4, "little") + extra + array("i", tokens).tobytes()).digest()


def test_chain_hash_is_sha256_of_the_documented_layout():
    first = chain_hash(None, BLOCK)
    assert first == oracle(ROOT, BLOCK) and len(first) == 32
    assert chain_hash(first, BLOCK[::-1], b"lora-7") == oracle(first, BLOCK[::-1], b"lora-7")
    assert chain_hash(None, tuple(BLOCK)) == first  # a tuple or a list of the same ids


def test_chain_hash_distinguishes_what_changes_the_kv():
    first = chain_hash(None, BLOCK)
    keys = {
        first,
        chain_hash(first, BLOCK),  # same tokens, deeper in the chain
        chain_hash(None, BLOCK[:-1] + [1016]),  # one token differs
        chain_hash(None, BLOCK[1:] + BLOCK[:1]),  # same tokens, other order
        chain_hash(None, BLOCK, b"adapter-a"),  # same tokens, another adapter
        chain_hash(None, BLOCK, b"adapter-b"),
        chain_hash(None, [70000] + BLOCK[1:]),  # ids past 16 bits are not truncated
    }
    assert len(keys) == 7
    # The extra key is length-prefixed, so it cannot be confused with the token bytes that follow it.
    assert chain_hash(None, [1], b"") != chain_hash(None, [], (1).to_bytes(4, "little"))


def test_chain_hash_is_stable_across_processes():
    # Python's hash() of str/bytes is salted per process; these digests must not be (a fresh interpreter with
    # another PYTHONHASHSEED gives the same one), so keys could be shared between processes later.
    code = "from lamina.cache.prefix_cache import chain_hash; print(chain_hash(None, list(range(1000, 1016))).hex())"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == chain_hash(None, BLOCK).hex()


def test_chain_hash_cost_per_block():
    # Loose bound (a shared CI core): measured ~1.6 us per 16-token block on one core.
    parent, n = chain_hash(None, BLOCK), 20000
    start = time.perf_counter()
    for _ in range(n):
        parent = chain_hash(parent, BLOCK)
    assert (time.perf_counter() - start) / n < 50e-6
