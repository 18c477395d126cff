"""`lamina chat`: an interactive chat in the terminal, streaming the reply as it is generated."""
from __future__ import annotations

import argparse
import sys


def add_chat_parser(sub) -> None:
    from lamina.cli import add_engine_args, add_sampling_args

    p = sub.add_parser("chat", help="interactive chat with streaming output")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=cmd_chat, max_tokens=512)


def stream_reply(engine, request_id: str, prompt_ids: list[int], params, out=sys.stdout) -> str:
    """Runs one request to completion, writing its text as it grows; returns the whole text."""
    engine.stream_outputs = True
    engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, params)
    shown = 0
    text = ""
    while True:
        for res in engine.step():
            if res.request_id != request_id:
                continue
            text = res.outputs[0].text
            out.write(text[shown:])
            out.flush()
            shown = len(text)
            if res.finished:
                out.write("\n")
                return text


def cmd_chat(args: argparse.Namespace) -> int:
    from lamina.cli import engine_kwargs, sampling_params
    from lamina.llm import LLM, chat_prompt_ids

    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("lamina chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = chat_prompt_ids(llm.engine.tokenizer, messages)
            reply = stream_reply(llm.engine, f"chat-{turn}", ids, params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        turn += 1
        messages.append({"role": "assistant", "content": reply})
