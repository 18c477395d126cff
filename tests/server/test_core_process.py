"""The engine core process behind `lamina serve`: its death fails requests without hanging the server;
SIGTERM/SIGINT drain and exit cleanly; a second signal exits at once; start-up phases are logged.

Each test starts its own server on a tiny random model (seconds to load) and takes it down itself.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
from server_helpers import Server, read_metrics, start_server

TINY = "random:tiny-llama"
PROMPT = list(range(100, 116))  # a random model has no tokenizer: token ids only


def _start(shutdown_timeout: float = 30.0, timeout: float = 180.0) -> Server:
    return start_server(["--shutdown-timeout", str(shutdown_timeout)], timeout, TINY, verbose=True,
                        base_args=["--max-model-len", "4096", "--kv-cache-memory-gb", "0.1"])


@pytest.fixture
def tiny():
    servers: list[Server] = []

    def start(**kw) -> Server:
        servers.append(_start(**kw))
        return servers[-1]

    yield start
    for s in servers:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(10)


def _core_pid(server: Server) -> int:
    m = re.search(r"engine core pid (\d+)", server.log_path.read_text())
    assert m, server.log()
    return int(m.group(1))


def _body(max_tokens: int, stream: bool) -> dict:
    return {"model": TINY, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


class StreamReader(threading.Thread):
    """Reads one SSE stream on a thread: its events, and whether [DONE] came."""

    def __init__(self, server: Server, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.max_tokens = server, max_tokens
        self.events: list[dict] = []
        self.done = False
        self.started = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=60) as http, \
                    http.stream("POST", self.server.api_url + "/completions", json=_body(self.max_tokens, True)) as r:
                assert r.status_code == 200
                self.started.set()  # headers are out (a model without a tokenizer streams no text)
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
        except Exception as e:  # noqa: BLE001 (reported by the test)
            self.error = e
        finally:
            self.started.set()

    def finish_reason(self) -> str | None:
        reasons = [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c.get("finish_reason")]
        return reasons[-1] if reasons else None


def _wait_running(server: Server, n: int) -> None:
    """Until n requests run and tokens are being generated."""
    deadline = time.monotonic() + 60
    while True:
        m = read_metrics(server.base_url)
        if m["lamina:num_requests_running"] >= n and m["lamina:generation_tokens_total"] > 0:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def _assert_clean_exit(server: Server, timeout: float) -> float:
    t0 = time.monotonic()
    code = server.proc.wait(timeout)
    log = server.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return time.monotonic() - t0


def test_killed_core_fails_requests_and_health(tiny):
    server = tiny()
    log = server.log_path.read_text()
    for phase in ("weights", "KV planning", "server ready"):  # start-up phases, with their times, at INFO
        assert re.search(rf"start-up: {phase} (took|in) [0-9.]+ s", log), log
    stream = StreamReader(server, 4000)
    stream.start()
    assert stream.started.wait(60) and stream.error is None
    result: dict = {}

    def non_streaming() -> None:
        result["r"] = httpx.post(server.api_url + "/completions", json=_body(4000, False), timeout=60)

    waiter = threading.Thread(target=non_streaming, daemon=True)
    waiter.start()
    _wait_running(server, 2)
    os.kill(_core_pid(server), signal.SIGKILL)
    t0 = time.monotonic()
    waiter.join(10)
    stream.join(10)
    assert time.monotonic() - t0 < 5, "requests waited on a dead core"
    assert result["r"].status_code == 500 and "engine core" in result["r"].json()["error"]["message"]
    assert stream.done and stream.error is None
    assert stream.events[-1]["error"]["type"] == "internal_server_error"  # a 500, in-band
    assert "engine core" in stream.events[-1]["error"]["message"]
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 503
    r = httpx.post(server.api_url + "/completions", json=_body(4, False), timeout=10)
    assert r.status_code == 503
    assert httpx.get(server.base_url + "/metrics", timeout=5).status_code == 200  # still answering
    server.proc.send_signal(signal.SIGTERM)
    _assert_clean_exit(server, 15)


def test_sigterm_drains_then_aborts_and_exits_0(tiny):
    server = tiny(shutdown_timeout=3)
    short, long = StreamReader(server, 12), StreamReader(server, 4000)
    long.start()
    assert long.started.wait(60)
    _wait_running(server, 1)
    short.start()
    assert short.started.wait(60)  # headers out: the core has admitted it (it may even be done already)
    server.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    # Not accepting any more (the listening socket is closed within uvicorn's 0.1 s poll).
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.base_url + "/health", timeout=2)
    took = _assert_clean_exit(server, 20) + 0.5
    short.join(5)
    long.join(5)
    for s in (short, long):
        assert s.error is None and s.done, s.error
    assert short.finish_reason() == "length"  # the short one finished within the timeout
    assert long.finish_reason() == "abort"  # the long one was cut at the timeout, with a clean end
    assert 2.5 < time.monotonic() - t0 and took < 10
    assert "aborted" in server.log_path.read_text()


def test_second_sigint_exits_at_once(tiny):
    server = tiny(shutdown_timeout=60)
    stream = StreamReader(server, 4000)
    stream.start()
    assert stream.started.wait(60)
    _wait_running(server, 1)
    core = _core_pid(server)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert server.proc.poll() is None  # draining: the stream is still running
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    server.proc.wait(5)
    assert time.monotonic() - t0 < 3
    assert "Traceback" not in server.log_path.read_text()
    deadline = time.monotonic() + 5
    while _alive(core):  # the core goes with the server
        assert time.monotonic() < deadline, "the engine core outlived the server"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def test_checkpoint_server_exits_without_leaked_semaphores(tmp_path):
    """A checkpoint on disk goes through the weight loader's progress bar, whose default lock is a
    multiprocessing semaphore; the core process ends through os._exit, so without a thread lock the
    resource tracker reports it as leaked at shutdown."""
    from server_helpers import start_server as start

    from lamina.bench.checkpoint import save_random_checkpoint

    ck = save_random_checkpoint("tiny-llama", tmp_path / "ck", dtype="float32")
    small = ["--max-model-len", "512", "--kv-cache-memory-gb", "0.05"]
    with pytest.raises(RuntimeError, match="has no tokenizer .*--skip-tokenizer-init"):  # one line, not a puzzle
        start([], 180, str(ck), base_args=small)
    server = start(["--skip-tokenizer-init"], 180, str(ck), base_args=small)
    r = httpx.post(server.api_url + "/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    server.proc.send_signal(signal.SIGTERM)
    _assert_clean_exit(server, 20)
    assert "leaked semaphore" not in server.log_path.read_text()
