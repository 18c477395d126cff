"""`lamina chat`: an interactive chat in the terminal, streaming the reply as it is generated.

Ctrl-C during a reply ends that reply (the conversation goes on); Ctrl-C or Ctrl-D at the prompt ends the
program. Neither prints a traceback.
"""
from __future__ import annotations

import argparse
import sys

from lamina.args import HelpFormatter, add_engine_args, add_sampling_args, engine_kwargs, sampling_params

# A small chat model answering greedily falls into repetition loops; sample unless the model says otherwise.
CHAT_FALLBACK = dict(max_tokens=512, temperature=0.7, top_p=0.9, top_k=0, min_p=0.0, repetition_penalty=1.05)


def add_chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat with streaming output", formatter_class=HelpFormatter)
    add_engine_args(p)
    add_sampling_args(p, CHAT_FALLBACK)
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's)")
    p.set_defaults(func=cmd_chat)


def stream_reply(llm, request_id: str, prompt_ids: list[int], params, out=sys.stdout) -> str:
    """Runs one request to completion, writing its text as it grows; returns the whole text. On Ctrl-C the
    request is aborted and the text so far is returned (the interrupt does not propagate)."""
    shown = 0
    text = ""
    replies = llm.stream({"prompt_token_ids": prompt_ids}, params, request_id)
    try:
        for res in replies:
            text = res.outputs[0].text
            out.write(text[shown:])
            out.flush()
            shown = len(text)
            if res.finished:
                out.write("\n")
                return text
    except KeyboardInterrupt:
        replies.close()  # aborts the request
        out.write(" [interrupted]\n")
        out.flush()
        return text
    finally:
        replies.close()
    return text


def cmd_chat(args: argparse.Namespace) -> int:
    from lamina.generation_config import model_defaults
    from lamina.llm import LLM

    params = sampling_params(args, model_defaults(args.model, args.generation_config))
    llm = LLM(**engine_kwargs(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    try:  # the banner inside: an interrupt right after it also ends the program cleanly
        print("lamina chat: type a message, /reset to start over, Ctrl-C to stop a reply, Ctrl-D to quit.",
              file=sys.stderr)
        _converse(llm, params, messages, args.system)
    except (EOFError, KeyboardInterrupt):  # Ctrl-D / Ctrl-C outside a reply: the program ends
        print(file=sys.stderr)
    return 0


def _converse(llm, params, messages: list[dict], system: str | None) -> None:
    from lamina.llm import chat_prompt_ids

    turn = 0
    while True:
        line = input("> ")
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = messages[:1] if system else []
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = chat_prompt_ids(llm.engine.tokenizer, messages)
            reply = stream_reply(llm, f"chat-{turn}", ids, params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        turn += 1
        messages.append({"role": "assistant", "content": reply})
