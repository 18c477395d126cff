"""vLLM's request and response extensions on /v1/completions and /v1/chat/completions, in one place so the
endpoint modules only call them: prompt logprobs in vLLM's shape, echo with logprobs (the prompt's tokens
first, the first one without a logprob), `token_id:N` token strings, prompt truncation, usage with the
optional prompt-token details and the per-chunk usage of `continuous_usage_stats`.
"""
from __future__ import annotations

from typing import Any

from lamina.outputs import PositionLogprobs
from lamina.server.responses import CompletionLogprobs, Usage


def token_id_str(token_id: int) -> str:
    """vLLM's return_tokens_as_token_ids spelling: unambiguous where a token does not decode on its own."""
    return f"token_id:{token_id}"


def truncate(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last `keep` prompt tokens (vLLM's truncate_prompt_tokens; -1: the model's context length)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    return ids[-keep:] if len(ids) > keep else ids


def prompt_logprobs_json(ids: list[int], positions: list[PositionLogprobs | None] | None,
                         as_ids: bool) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, rank,
    decoded_token}} with the prompt's own token and the top-N."""
    if positions is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for pos in positions[:len(ids)]:
        if pos is None:
            out.append(None)
            continue
        out.append({str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                               "decoded_token": token_id_str(tid) if as_ids else lp.decoded_token}
                    for tid, lp in pos.items()})
    return out


def echo_logprobs(ids: list[int], positions: list[PositionLogprobs | None], num: int, first_token: str,
                  as_ids: bool) -> CompletionLogprobs:
    """Completions logprobs of the echoed prompt: its tokens, their logprobs (None for the first, which has
    no context) and top-`num` alternatives; offsets count from the start of the echoed text."""
    out = CompletionLogprobs()
    offset = 0
    for i, (tid, pos) in enumerate(zip(ids, positions)):
        if pos is None or tid not in pos:
            token = token_id_str(tid) if as_ids else (first_token if i == 0 else "")
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            lp = pos[tid]
            token = token_id_str(tid) if as_ids else (lp.decoded_token or "")
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            ranked = sorted((x for x in pos.items() if x[1].rank is not None and x[1].rank <= num),
                            key=lambda x: x[1].rank)
            top = {(token_id_str(t) if as_ids else (v.decoded_token or "")): v.logprob for t, v in ranked}
            top.setdefault(token, lp.logprob)
            out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def join_logprobs(first: CompletionLogprobs, second: CompletionLogprobs | None) -> CompletionLogprobs:
    """The echoed prompt's logprobs followed by the completion's (whose offsets continue after the echo)."""
    if second is None:
        return first
    return CompletionLogprobs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens,
                              top_logprobs=first.top_logprobs + second.top_logprobs)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, details: bool) -> Usage:
    """OpenAI's usage object; prompt_tokens_details (the prefix-cache hits) only when the server was started
    with --enable-prompt-tokens-details, so a default usage object is exactly OpenAI's three numbers."""
    u = Usage.of(prompt_tokens, completion_tokens, cached_tokens)
    if not details:
        u.prompt_tokens_details = None
    return u
