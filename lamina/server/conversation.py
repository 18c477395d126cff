"""Turns a conversation with tools into prompt token ids, for the Anthropic Messages and OpenAI Responses
endpoints (both convert their own shapes into OpenAI-style message dicts first).

Messages here are OpenAI chat dicts: {"role", "content": str, "tool_calls": [{"id", "type": "function",
"function": {"name", "arguments": dict}}], "tool_call_id"}. A template that knows tools (it mentions `tools`
or `tool_calls`) gets them as Hugging Face defines them (`apply_chat_template(tools=...)`, arguments as
dicts). A template that does not would drop them silently, so they are written into the conversation
instead in the Hermes format the fallback parser reads back (agent_output.py): the tool list in the system
turn, calls as `<tool_call>` text, results as `<tool_response>` user turns.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from lamina.server.agent_output import (
    CALL_CLOSE,
    CALL_OPEN,
    THINK_OPEN,
    OneCall,
    OutputSplitter,
    ParsedSplitter,
    Splitter,
    make_splitter,
)
from lamina.server.agent_plan import AgentPlan
from lamina.server.errors import bad_request
from lamina.server.serving import ServerState


@dataclass
class Prompt:
    ids: list[int]
    starts_in_reasoning: bool  # the rendered prompt ends inside an opened <think> block
    prefill: str  # text appended after the generation prompt (the reply continues it)
    tail: str = ""  # the rendered prompt's last characters (reasoning parsers read whether it opened <think>)


def template_knows_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template or "tool_calls" in template


def _tools_system_text(tools: list[dict]) -> str:
    lines = ["You may call one or more functions to assist with the user query.",
             "You are provided with function signatures within <tools></tools> XML tags:", "<tools>"]
    lines += [json.dumps(t, ensure_ascii=False) for t in tools]
    lines += ["</tools>", "For each function call, return a json object with function name and arguments within "
              f"{CALL_OPEN}{CALL_CLOSE} XML tags:",
              f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}']
    return "\n".join(lines)


def _inline_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a template without tool support: everything written as plain turns."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [f"{CALL_OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                     + f"\n{CALL_CLOSE}" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + calls)})
        elif role == "tool":
            body = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + body  # consecutive results share one turn
            else:
                out.append({"role": "user", "content": body, "_tool_results": True})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_results", None)
    if tools:
        text = _tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render_prompt(state: ServerState, messages: list[dict], tools: list[dict] | None = None,
                  template_kwargs: dict[str, Any] | None = None, prefill: str = "") -> Prompt:
    """Prompt ids for `messages`. A last assistant message is continued (its text is the start of the reply,
    as Anthropic's API defines it), otherwise the generation prompt opens a new assistant turn. `tools` are
    OpenAI-style function tools ({"type": "function", "function": {...}}); `prefill` is appended after the
    generation prompt. Template failures are 400s on "messages"."""
    tokenizer = state.need_tokenizer("messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model's tokenizer has no chat template", "messages")
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    native = template_knows_tools(tokenizer)
    msgs = messages if native else _inline_tools(messages, tools)
    # An assistant turn that ends in tool calls is finished (its results come next); only text is continued.
    last = messages[-1]
    continue_final = last["role"] == "assistant" and not last.get("tool_calls") and bool(last.get("content"))
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if native and tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=not continue_final,
                                             continue_final_message=continue_final, **kwargs)
    except (ValueError, TypeError, KeyError, TemplateError) as e:
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None
    text += prefill
    # The template writes the special tokens itself; encoding must not add a second BOS.
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    return Prompt(ids=ids, starts_in_reasoning=text.rstrip().endswith(THINK_OPEN), prefill=prefill,
                  tail=text[-256:])


def _configured_parsers(state: ServerState) -> tuple[Any, Any]:
    """The parser classes named at start-up (ServerState.reasoning_parser / tool_call_parser, vLLM's
    --reasoning-parser / --tool-call-parser names; absent or None when not configured)."""
    reasoning_name = getattr(state, "reasoning_parser", None)
    tool_name = getattr(state, "tool_call_parser", None)
    reasoning_cls = tool_cls = None
    if reasoning_name:
        from lamina.server.reasoning import get_reasoning_parser

        reasoning_cls = get_reasoning_parser(reasoning_name)
    if tool_name:
        from lamina.server.tools import get_parser

        tool_cls = get_parser(tool_name)
    return reasoning_cls, tool_cls


def splitter_for(state: ServerState, prompt: Prompt, tools: list[dict] | None, thinking: bool,
                 parallel_calls: bool = True, plan: AgentPlan | None = None) -> Splitter:
    """The output splitter of one reply: the server's configured parsers win over the built-in `<think>` /
    Hermes formats. Without parallel_calls only the first tool call is kept. A constrained reply (plan) is
    JSON from its first token: a forced call's is read by the plan's parser, an output format's is text."""
    if plan is not None and plan.forced_parser is not None:
        return ParsedSplitter(None, plan.forced_parser)
    if plan is not None and plan.constraint is not None:
        return OutputSplitter()
    reasoning_cls, tool_cls = _configured_parsers(state)
    if not parallel_calls:
        return OneCall(splitter_for(state, prompt, tools, thinking))
    return make_splitter(reasoning_cls, tool_cls, reasoning=thinking, tools=tools, prompt_tail=prompt.tail,
                         starts_in_reasoning=prompt.starts_in_reasoning, prefix=prompt.prefill)


def keeps_special_tokens(state: ServerState, tools: list[dict] | None, plan: AgentPlan | None = None) -> bool:
    """Whether the reply must be detokenized with its special tokens (a tool format whose markers are; a
    constrained reply is plain JSON)."""
    if plan is not None and plan.constraint is not None:
        return False
    _, tool_cls = _configured_parsers(state)
    return bool(tools) and tool_cls is not None and bool(getattr(tool_cls, "needs_special_tokens", False))
