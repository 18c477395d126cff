"""The data-parallel router and the replicas' stats, host-side (no processes)."""
from __future__ import annotations

import pytest

from lamina.engine.dp_client import replica_gpus, sum_stats
from lamina.engine.dp_router import PrefixRouter, prefix_hashes
from lamina.engine.engine_stats import EngineStats

A = list(range(100, 164))  # 4 blocks of 16
B = list(range(500, 564))


def test_hashes_are_chained_over_full_blocks():
    h = prefix_hashes(A, 16)
    assert len(h) == 4 and len(set(h)) == 4
    assert prefix_hashes(A[:40], 16) == h[:2]  # a partial block is not recorded
    changed = [A[0] + 1] + A[1:]
    assert not set(prefix_hashes(changed, 16)) & set(h)  # block 0 differs: every later hash differs
    assert prefix_hashes("x" * 130, 16) == prefix_hashes("x" * 128, 16)  # text: chunks of 64 characters


def test_round_robin_then_prefix():
    r = PrefixRouter(2, 16)
    assert r.choose(A, [0, 0]).replica == 0
    assert r.choose(B, [0, 0]).replica == 1
    again = r.choose(B, [0, 0])
    assert (again.replica, again.matched_blocks) == (1, 4)
    assert r.choose(A[:48] + [7] * 16, [0, 0]).replica == 0  # shares 3 blocks with A
    assert r.choose([9] * 64, [0, 0]).matched_blocks == 0


def test_load_margin_overrides_the_prefix():
    r = PrefixRouter(2, 16, load_margin=2)
    assert r.choose(A, [0, 0]).replica == 0
    assert r.choose(A, [2, 0]).replica == 0  # within the margin: the cached replica
    route = r.choose(A, [3, 0])
    assert (route.replica, route.matched_blocks) == (1, 0)  # past it: the least loaded


def test_dead_replicas_are_skipped_and_forgotten():
    r = PrefixRouter(3, 16)
    r.choose(A, [0, 0, 0])
    assert r.choose(A, [0, 0, 0], usable=[False, True, True]).replica in (1, 2)
    r.forget(0)
    assert r.choose(B, [5, 0, 0], usable=[True, False, False]).replica == 0
    with pytest.raises(ValueError):
        r.choose(A, [0, 0, 0], usable=[False, False, False])


def test_record_is_bounded():
    r = PrefixRouter(1, 16, capacity=8)
    for k in range(10):
        r.choose(list(range(k * 1000, k * 1000 + 64)), [0])
    assert len(r._seen[0]) == 8


def test_replica_gpus():
    assert replica_gpus(0, 2, None) == "0,1" and replica_gpus(1, 2, None) == "2,3"
    assert replica_gpus(1, 1, "4,6,7") == "6"
    with pytest.raises(ValueError, match="replica 1 needs GPUs 2..3"):
        replica_gpus(1, 2, "0,1,2")


def test_stats_sum():
    a = EngineStats(1, 2, 10, 20, num_preemptions=3, spec_accepted_per_position=[1, 2])
    b = EngineStats(0, 1, 20, 20, num_preemptions=1, spec_accepted_per_position=[5])
    s = sum_stats([a, b])
    assert (s.num_running, s.num_waiting, s.num_free_blocks, s.num_total_blocks) == (1, 3, 30, 40)
    assert s.num_preemptions == 4 and s.spec_accepted_per_position == [6, 2]
    assert s.kv_cache_usage == pytest.approx(0.25)


class _FakeClient:
    """What DPClient asks of a replica's CoreClient, for start-up."""

    def __init__(self, error: str | None) -> None:
        self.error, self.started, self.stopped, self.info = error, False, False, None

    def start(self, wait: bool = True) -> None:
        self.started = True

    def wait_ready(self, timeout=None) -> None:
        if self.error:
            raise RuntimeError(self.error)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.stopped = True


def test_a_replica_failing_to_start_fails_all_with_one_line():
    from lamina.engine.dp_client import DPClient

    clients = [_FakeClient(None), _FakeClient("out of memory")]
    with pytest.raises(RuntimeError, match=r"^data-parallel replica 1: out of memory$"):
        DPClient(clients, 16).start()
    assert all(c.started and c.stopped for c in clients)


def test_cli_flags():
    from lamina.cli import build_parser

    args = build_parser().parse_args(["serve", "m", "-dp", "2", "-tp", "2", "--distributed-executor-backend", "ray"])
    assert args.data_parallel_size == 2
    from lamina.args import engine_kwargs

    assert engine_kwargs(args)["distributed_executor_backend"] == "ray"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--data-parallel-size", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--distributed-executor-backend", "slurm"])


def test_a_device_index_is_refused_before_anything_starts():
    from lamina.config import EngineConfig
    from lamina.engine.dp_client import DPClient

    with pytest.raises(ValueError, match="not cuda:1"):
        DPClient.spawn(EngineConfig(model="random:tiny-llama", device="cuda:1"), 2)
