"""Helpers of the server tests: start/stop a real `lamina serve` process, read its /metrics."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"
# Small context and KV pool: quick to allocate, and a "too long" prompt stays cheap to build.
MAX_MODEL_LEN = 512
SERVER_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gb", "0.25", "--max-num-seqs", "128"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def start_server(extra: list[str], timeout: float = 240.0, model: str = MODEL, base_args: list[str] | None = None,
                 verbose: bool = False) -> Server:
    """`lamina serve model` on a free port (base_args: SERVER_ARGS unless given), once /health answers 200."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="lamina-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "lamina.cli", *(["-v"] if verbose else []), "serve", model, "--port", str(port),
           *(SERVER_ARGS if base_args is None else base_args), *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lamina serve exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop_server(server)
    raise RuntimeError(f"lamina serve did not become healthy in {timeout}s:\n{server.log()}")


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(15)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(5)


def read_metrics(base_url: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (one model per server, so that is one value)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def wait_idle(base_url: str, timeout: float = 20.0) -> dict[str, float]:
    """Waits until no request runs or waits and every KV block is free; fails the test otherwise."""
    deadline = time.monotonic() + timeout
    m: dict[str, float] = {}
    while time.monotonic() < deadline:
        m = read_metrics(base_url)
        if (m["lamina:num_requests_running"] == 0 and m["lamina:num_requests_waiting"] == 0
                and m["lamina:kv_cache_free_blocks"] == m["lamina:kv_cache_total_blocks"]):
            return m
        time.sleep(0.1)
    raise AssertionError(f"server not idle after {timeout}s: running={m.get('lamina:num_requests_running')} "
                         f"waiting={m.get('lamina:num_requests_waiting')} free={m.get('lamina:kv_cache_free_blocks')}"
                         f"/{m.get('lamina:kv_cache_total_blocks')}")


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Runs an app with uvicorn on a thread of this process (to reach inside, or to skip a model load)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited during start-up")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def raw_exchange(base_url: str, request: bytes, timeout: float = 30.0) -> bytes:
    """Sends raw bytes to the server and returns everything it answers until it closes the connection."""
    host, port = base_url.removeprefix("http://").split(":")
    reply = b""
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        while chunk := s.recv(4096):
            reply += chunk
    return reply
