"""Streamed chunks built without pydantic on the hot path.

Each streamed token of a plain request (no logprobs, no token ids, no usage per chunk, no output parsing)
is one SSE chunk. Building and dumping the pydantic chunk models cost ~70 us of the server process's one
core per token (scripts/server_token_cost.py, 256 streams), the largest part of what the server did per
token. A request's envelope (id, object, created, model) never changes, so it is serialized once, and each
chunk adds only its choice, as JSON from a plain dict. The bytes equal what the pydantic models give
(tests/server/test_stream_chunks.py compares them); everything else still goes through the models.
"""
from __future__ import annotations

import json

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class ChunkWriter:
    """SSE chunks of one streamed request. kind: "text_completion" (/v1/completions) or
    "chat.completion.chunk" (/v1/chat/completions)."""

    def __init__(self, kind: str, request_id: str, created: int, model: str) -> None:
        self.kind = kind
        self._head = (f'data: {{"id":{_dumps(request_id)},"object":"{kind}","created":{int(created)},'
                      f'"model":{_dumps(model)},"choices":[')
        tail = ',"prompt_token_ids":null' if kind == "chat.completion.chunk" else ""
        self._tail = f'],"usage":null{tail}}}\n\n'

    def completion(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> str:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": stop_reason, "prompt_logprobs": None, "prompt_token_ids": None, "token_ids": None}
        return self._head + _dumps(choice) + self._tail

    def chat_content(self, index: int, content: str | None, finish_reason: str | None,
                     stop_reason: int | str | None) -> str:
        choice = {"index": index, "delta": {"role": None, "content": content}, "logprobs": None,
                  "finish_reason": finish_reason, "stop_reason": stop_reason, "token_ids": None}
        return self._head + _dumps(choice) + self._tail
