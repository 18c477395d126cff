"""The pydantic-free chunk writer gives the same bytes as the pydantic chunk models it stands in for."""
from __future__ import annotations

import pytest

from lamina.server.responses import ChatCompletionChunk, ChatStreamChoice, CompletionChoice, CompletionResponse, Delta
from lamina.server.serving import sse
from lamina.server.stream_chunks import ChunkWriter

TEXTS = ["", " hello", "naïve — ünïcode 漢字 🙂", 'quote " backslash \\ slash /', "tab\tnew\nline\r\x00\x1f\x7f",
         "\u2028\u2029", "{\"json\": [1, 2]}"]
ENDS = [(None, None), ("stop", None), ("stop", 13), ("stop", "</s>"), ("length", None), ("abort", None)]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish,stop", ENDS)
def test_completion_chunk_bytes(text, finish, stop):
    w = ChunkWriter("text_completion", "cmpl-1a2b", 1764590000, "my/model \"x\"")
    want = sse(CompletionResponse(id="cmpl-1a2b", created=1764590000, model="my/model \"x\"", choices=[
        CompletionChoice(index=3, text=text, logprobs=None, finish_reason=finish, stop_reason=stop)]))
    assert w.completion(3, text, finish, stop) == want


@pytest.mark.parametrize("text", TEXTS[1:] + [None])
@pytest.mark.parametrize("finish,stop", ENDS)
def test_chat_chunk_bytes(text, finish, stop):
    w = ChunkWriter("chat.completion.chunk", "chatcmpl-9", 17, "m")
    want = sse(ChatCompletionChunk(id="chatcmpl-9", created=17, model="m", choices=[
        ChatStreamChoice(index=1, delta=Delta(content=text), finish_reason=finish, stop_reason=stop)]))
    assert w.chat_content(1, text, finish, stop) == want
