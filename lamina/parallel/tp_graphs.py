"""CUDA graphs under tensor parallelism: every rank replays the graph rank 0 chose.

NCCL collectives can be captured in CUDA graphs (gloo ones cannot: the CPU path never captures). Two rules make
graphs safe with several ranks:
- capture is collective: each captured body runs all-reduces / all-gathers, so every rank captures the same
  keys in the same order (`CudaGraphRunner.capture` walks `capture_order(keys)`, a pure function of the
  keys, which every rank derives from the same engine config and the same pool size), and a capture that fails
  on one rank is fatal (`strict`) instead of falling back to eager on that rank alone;
- replay is rank 0's decision: rank 0 picks the key for the step (`graph_slot`), the step message carries it
  (header slot 7), and a worker replays exactly that graph (`graph_for`) without picking again, so a host-side
  difference can never make one rank replay while another runs eagerly (which would deadlock the collectives).

Checked on the CPU only (tests/test_tp_graphs.py: the message, the replay choice, the capture order). Needs a
multi-GPU machine: that ProcessGroupNCCL's all-reduce / all-gather (parallel/context.py, waited with
`work.wait()`) record into a capture on the capture stream without a host sync (no TORCH_NCCL_BLOCKING_WAIT),
that graph replays at TP=2 give the eager steps' tokens, and that the graphs' warm-up bodies run before
capture initialize the NCCL communicators (a first collective inside a capture would fail).
"""
from __future__ import annotations

from lamina.engine.graph_keys import GraphKey

EAGER = 0  # the slot of a step that runs eagerly


def graph_slot(graphs, batch) -> int:
    """Rank 0: the step's graph as a number every rank understands: 0 eager, i + 1 for graphs.keys[i]."""
    if graphs is None:
        return EAGER
    key = graphs.pick(batch)
    return EAGER if key is None else graphs.keys.index(key) + 1


def graph_for(graphs, slot: int) -> GraphKey | None:
    """A worker: the key of rank 0's `slot` (None: eager). Refuses a slot this rank did not capture (the
    ranks' graph sets differ: a configuration bug that would otherwise hang a collective)."""
    if slot == EAGER:
        return None
    if graphs is None or not 0 < slot <= len(graphs.keys) or graphs.keys[slot - 1] not in graphs.graphs:
        have = 0 if graphs is None else len(graphs.graphs)
        raise RuntimeError(f"rank 0 replays CUDA graph #{slot}, which this rank did not capture ({have} graphs)")
    return graphs.keys[slot - 1]
