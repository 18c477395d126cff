"""A trivial OpenAI-compatible streaming server with no model: the ceiling of `lamina bench serve` itself.

Every /v1/completions or /v1/chat/completions request (stream: true) gets max_tokens one-token SSE chunks, then
a finish chunk, a usage chunk and [DONE]; between tokens the request yields to the event loop (or sleeps
--step-ms), so concurrent streams interleave chunk by chunk as they do behind a real engine. /v1/models lists
one model, "fake". Plain asyncio and hand-written HTTP/1.1 (keep-alive, chunked), so a server process costs
far less per token than the client parsing it; --workers N runs N processes on one port (SO_REUSEPORT).

    python -m lamina.bench.fake_server --port 8100 --workers 2
    lamina bench serve --fake-server ...        (starts one on a free port, loads it, stops it)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx

_TEXT = " tok"  # one token per chunk; its text is all a client needs to see a token arrive


def _chunk(payload: dict) -> bytes:
    data = b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _token_chunk(chat: bool, finish: str | None = None) -> bytes:
    if chat:
        choice = {"index": 0, "delta": {"content": _TEXT}, "finish_reason": finish}
        return _chunk({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                       "choices": [choice]})
    choice = {"index": 0, "text": _TEXT, "logprobs": None, "finish_reason": finish}
    return _chunk({"id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "fake", "choices": [choice]})


# Built once: every token chunk of a kind is the same bytes.
_TOKEN = {False: _token_chunk(False), True: _token_chunk(True)}
_LAST = {False: _token_chunk(False, "length"), True: _token_chunk(True, "length")}
_DONE = b"%x\r\n%s\r\n0\r\n\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n")
_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")


def _response(status: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
            .encode() + data)


def _prompt_tokens(body: dict, chat: bool) -> int:
    """Token ids count as themselves, text as one token per word (the client's "words" prompts)."""
    if chat:
        return sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
    prompt = body.get("prompt", "")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())


class FakeServer:
    """Serves connections; step_s: seconds between two tokens of one stream (0: just yield)."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                request_line, *lines = head.split("\r\n")
                method, path = request_line.split(" ")[:2]
                headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines if x)}
                n = int(headers.get("content-length", "0"))
                body = await reader.readexactly(n) if n else b""
                if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    await self._stream(writer, json.loads(body), chat=path.endswith("chat/completions"))
                elif method == "GET" and path == "/v1/models":
                    writer.write(_response("200 OK", {"object": "list", "data": [{"id": "fake", "object": "model"}]}))
                elif method == "GET" and path == "/health":
                    writer.write(_response("200 OK", {}))
                else:
                    writer.write(_response("404 Not Found", {"error": {"message": f"no route {path}"}}))
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass  # the client went away, or sent something this server does not parse
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, body: dict, chat: bool) -> None:
        n = max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or 16))
        writer.write(_STREAM_HEAD)
        token = _TOKEN[chat]
        for _ in range(n - 1):
            writer.write(token)
            if writer.transport.get_write_buffer_size() > (1 << 18):
                await writer.drain()
            await asyncio.sleep(self.step_s)
        writer.write(_LAST[chat])
        if (body.get("stream_options") or {}).get("include_usage"):
            p = _prompt_tokens(body, chat)
            writer.write(_chunk({"id": "fake", "object": "chat.completion.chunk" if chat else "text_completion",
                                 "created": 0, "model": "fake", "choices": [],
                                 "usage": {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}}))
        writer.write(_DONE)


async def serve(host: str, port: int, step_s: float, reuse_port: bool) -> None:
    server = await asyncio.start_server(FakeServer(step_s).handle, host, port, reuse_port=reuse_port,
                                        backlog=4096)
    async with server:
        await server.serve_forever()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start(port: int, workers: int = 1, step_ms: float = 0.0, host: str = "127.0.0.1",
          wait_s: float = 60.0) -> list[subprocess.Popen]:
    """Starts the fake server as `workers` processes on one port; returns them once /v1/models answers."""
    cmd = [sys.executable, "-m", "lamina.bench.fake_server", "--host", host, "--port", str(port),
           "--step-ms", str(step_ms), "--reuse-port"]
    procs = [subprocess.Popen(cmd) for _ in range(workers)]
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if httpx.get(f"http://{host}:{port}/v1/models", timeout=2).status_code == 200:
                # Each worker binds on its own; give the last ones a moment after the first answers.
                time.sleep(0.2 * (workers > 1))
                return procs
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            stop(procs)
            raise RuntimeError(f"the fake server did not come up on {host}:{port}")
        time.sleep(0.1)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lamina.bench.fake_server", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--workers", type=int, default=1, help="server processes sharing the port")
    p.add_argument("--step-ms", type=float, default=0.0, help="pause between two tokens of a stream")
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.workers > 1:
        procs = start(args.port, args.workers, args.step_ms, args.host)
        try:
            for proc in procs:
                proc.wait()
        finally:
            stop(procs)
        return 0
    try:
        asyncio.run(serve(args.host, args.port, args.step_ms / 1000.0, args.reuse_port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
