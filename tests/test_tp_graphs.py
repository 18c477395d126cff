"""CUDA graphs under tensor parallelism, host side on the CPU (no graph is captured here: gloo collectives
cannot be, and there is no GPU): rank 0's graph choice travels in the step message and workers replay exactly
it; every rank derives the same keys and captures them in the same order; a capture that fails under tensor
parallelism is fatal rather than a fallback on one rank. What only a multi-GPU machine can check (NCCL
collectives inside captured graphs, replays equal to eager steps) is listed in lamina/parallel/tp_graphs.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_cuda_graph_host import _Stub

from lamina.engine.cuda_graph import CudaGraphRunner, capture_order
from lamina.engine.runner import ForwardBatch, ModelRunner
from lamina.kernels.attention import AttentionMetadata
from lamina.kernels.metadata import StepContext
from lamina.parallel.step_message import recv_step, send_step
from lamina.parallel.tp_graphs import EAGER, graph_for, graph_slot

CPU = torch.device("cpu")


class _Wire:
    """Broadcasts between a 'rank 0' and a 'worker' in one process: rank 0's tensors queue, the worker's
    receive buffers are filled from the queue in order."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def rank(self, r: int):
        def broadcast(x: torch.Tensor) -> torch.Tensor:
            if r == 0:
                self.sent.append(x.clone())
            else:
                x.copy_(self.sent.pop(0))
            return x

        return SimpleNamespace(rank=r, world=2, broadcast=broadcast)


def _batch(tokens: int, seqs: int, graph_slot=None) -> ForwardBatch:
    """A decode-only step (tokens == seqs) or a prefill chunk plus decode rows."""
    lens = [tokens - seqs + 1] + [1] * (seqs - 1)
    qs = np.concatenate([[0], np.cumsum(lens)]).tolist()
    ctx_lens = [n + 3 for n in lens]
    attn = AttentionMetadata(torch.arange(tokens), torch.tensor(qs, dtype=torch.int32),
                             torch.tensor(ctx_lens, dtype=torch.int32), torch.zeros(seqs, 4, dtype=torch.int32),
                             qs, ctx_lens, max(lens), max(ctx_lens))
    empty = np.zeros(0, np.int64)
    logits = torch.tensor(qs[1:]) - 1
    return ForwardBatch(torch.arange(tokens) + 5, torch.arange(tokens), StepContext(attn), logits, empty, empty,
                        None, [], [], graph_slot=graph_slot)


class _Graphs:
    """The parts of CudaGraphRunner the runner uses: keys, the captured set, pick and run (recorded)."""

    def __init__(self, runner: CudaGraphRunner, pick_override=None) -> None:
        self.keys, self.graphs = runner.keys, {k: object() for k in runner.keys}
        self._real, self._override, self.replayed = runner, pick_override, []

    def pick(self, batch):
        return self._override if self._override is not None else self._real.pick(batch)

    def run(self, batch, key=None):
        self.replayed.append(key)
        return torch.zeros(len(batch.logits_indices), 3)


def _runner(**kw) -> CudaGraphRunner:
    return CudaGraphRunner(_Stub(), 8, 64, 4, CPU, max_num_batched_tokens=64, **kw)


@pytest.mark.parametrize("tokens,seqs", [(3, 3), (20, 4)], ids=["decode", "mixed"])
def test_the_step_message_carries_rank0s_graph_and_the_worker_replays_it(tokens, seqs):
    wire = _Wire()
    rank0 = _Graphs(_runner())
    sent = []
    r0 = SimpleNamespace(step_sink=lambda b: (sent.append(b), send_step(wire.rank(0), b)), graphs=rank0,
                         keep_hidden=False)
    r0.execute = lambda b: ModelRunner.execute(SimpleNamespace(step_sink=None, graphs=rank0, keep_hidden=False), b)
    ModelRunner._execute_parallel(r0, _batch(tokens, seqs))
    key = rank0._real.pick(_batch(tokens, seqs))
    assert key is not None and rank0.replayed == [key]
    assert sent[0].graph_slot == rank0.keys.index(key) + 1
    # The worker's own pick would choose another graph: it must replay rank 0's, not pick.
    other = next(k for k in rank0.keys if k != key)
    worker = _Graphs(_runner(), pick_override=other)
    batch = recv_step(wire.rank(1), CPU, 4, None)
    assert batch.graph_slot == sent[0].graph_slot and torch.equal(batch.input_ids, sent[0].input_ids)
    ModelRunner.execute(SimpleNamespace(step_sink=None, graphs=worker, keep_hidden=False), batch)
    assert worker.replayed == [key]


def test_an_eager_step_stays_eager_on_every_rank():
    wire = _Wire()
    big = _batch(70, 2)  # beyond the largest mixed graph (64 tokens)
    assert graph_slot(_Graphs(_runner()), big) == EAGER and graph_slot(None, big) == EAGER
    send_step(wire.rank(0), big)  # graph_slot None: sent as eager
    batch = recv_step(wire.rank(1), CPU, 4, None)
    assert batch.graph_slot == EAGER and graph_for(_Graphs(_runner()), batch.graph_slot) is None


def test_a_slot_the_worker_did_not_capture_is_refused():
    few = _Graphs(_runner(mixed=False))  # decode graphs only
    with pytest.raises(RuntimeError, match="did not capture"):
        graph_for(few, len(_runner().keys))
    with pytest.raises(RuntimeError, match="did not capture"):
        graph_for(None, 1)


def test_every_rank_captures_the_same_keys_in_the_same_order(monkeypatch):
    """Capture is collective: two ranks built from the same config walk the same keys in the same order
    (largest first); under tensor parallelism (strict) a failed capture raises instead of dropping that
    rank's mixed graphs alone."""
    for name, value in (("memory_reserved", lambda *a: 0), ("Stream", lambda *a: None),
                        ("synchronize", lambda *a: None)):
        monkeypatch.setattr(torch.cuda, name, value)
    orders = []
    for _ in range(2):
        runner, seen = _runner(strict=True), []
        monkeypatch.setattr(runner, "_capture", lambda key, stream, seen=seen: seen.append(key))
        runner.capture()
        orders.append(seen)
    assert orders[0] == orders[1] == capture_order(_runner().keys)
    assert [k.tokens for k in orders[0]] == sorted((k.tokens for k in orders[0]), reverse=True)

    def fail_mixed(key, stream):
        if not key.decode:
            raise RuntimeError("capture failed")

    lenient, strict = _runner(), _runner(strict=True)
    for r in (lenient, strict):
        monkeypatch.setattr(r, "_capture", fail_mixed)
    lenient.capture()  # one process: mixed steps run eagerly, decode graphs stay
    assert lenient.mixed_sizes == []
    with pytest.raises(RuntimeError, match="capture failed"):
        strict.capture()
