"""`lamina serve [MODEL]`: load the engine, then serve the OpenAI-compatible API with uvicorn."""
from __future__ import annotations

import argparse
import gc
import logging
import os

from lamina.args import (
    HelpFormatter,
    add_engine_args,
    add_generation_config_arg,
    engine_kwargs,
    nonnegative_int,
    port_number,
    positive_float,
    positive_int,
)

log = logging.getLogger("lamina.server")


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter)
    add_engine_args(p, positional_model=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API answers to (default: the model argument); the first is reported")
    p.add_argument("--api-key", default=os.environ.get("LAMINA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize "
                        "(default: $LAMINA_API_KEY, or no key)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are "
                        "aborted (default: 30)")
    p.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1,
                   help="run this many engine cores (replicas, each of --tensor-parallel-size GPUs) behind this "
                        "one server; requests are routed by prompt prefix and load (default: 1)")
    add_generation_config_arg(p)
    p.add_argument("--max-request-body-mb", type=positive_float, default=4.0,
                   help="larger request bodies get a 413")
    p.add_argument("--header-timeout", type=positive_float, default=10.0,
                   help="seconds a connection may take to send a request's line and headers before it is closed")
    p.add_argument("--http", choices=["auto", "h11", "httptools"], default="auto",
                   help="the HTTP parser (auto: httptools when installed, else h11)")
    p.add_argument("--body-timeout", type=positive_float, default=30.0,
                   help="seconds a request may take to send its body, once its headers are in (then a 408)")
    p.add_argument("--enable-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (default: off; behind --api-key when one is set)")
    add_output_parsing_args(p)
    p.add_argument("--responses-store-size", type=nonnegative_int, default=0,
                   help="Responses API: keep this many responses in memory for previous_response_id and GET "
                        "/v1/responses/{id} (least recently used go first; default: 0, stateless)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="add usage.prompt_tokens_details (prefix-cache hits as cached_tokens) to OpenAI responses; "
                        "off: usage objects are exactly OpenAI's default three numbers")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=cmd_serve)


def add_output_parsing_args(p) -> None:
    from lamina.server.reasoning import PARSERS as REASONING
    from lamina.server.tools import PARSERS as TOOLS

    p.add_argument("--tool-call-parser", choices=sorted(TOOLS), default=None,
                   help="how the model writes tool calls (needed for tool_choice 'auto')")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide when to call tools (tool_choice 'auto'; needs --tool-call-parser)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING), default=None,
                   help="split <think>...</think> into the message's reasoning (and reasoning_content)")


def _interrupt(sig: int, frame) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import time

    import uvicorn

    from lamina.config import EngineConfig
    from lamina.generation_config import model_defaults
    from lamina.preflight import bind_socket
    from lamina.server.app import ServerOptions, build_app, make_state
    from lamina.server.graceful import GracefulServer
    from lamina.server.limits import head_timeout_protocol

    t0 = time.monotonic()
    if args.shutdown_timeout < 0:
        log.error("--shutdown-timeout must be >= 0")
        return 2
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        log.error("--enable-auto-tool-choice needs --tool-call-parser")
        return 2
    sock = bind_socket(args.host, args.port)  # a port in use fails now, not after loading the model
    defaults = model_defaults(args.model, args.generation_config)
    names = args.served_model_name or [args.model]
    # The engine core process loads the model before the server runs, so /health answering means ready.
    # A signal during loading ends it quietly (the core process goes with make_state's clean-up).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        state = make_state(EngineConfig(**engine_kwargs(args)), names, args.api_key, defaults,
                           prompt_tokens_details=args.enable_prompt_tokens_details,
                           data_parallel_size=args.data_parallel_size)
    except (RuntimeError, ValueError) as e:
        log.error("lamina serve: %s", e)
        return 1
    except KeyboardInterrupt:
        log.warning("lamina serve: interrupted during start-up")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    state.tool_call_parser, state.enable_auto_tool_choice = args.tool_call_parser, args.enable_auto_tool_choice
    state.reasoning_parser = args.reasoning_parser
    options = ServerOptions(max_body_bytes=int(args.max_request_body_mb * 2**20), body_timeout=args.body_timeout,
                            enable_docs=args.enable_docs, responses_store_size=args.responses_store_size)
    app = build_app(state, options)
    info = state.engine.info

    def ready() -> None:  # the socket listens: now say so
        log.info("start-up: server ready in %.2f s (engine core pid %d, its start-up %.2f s)",
                 time.monotonic() - t0, info.pid, info.startup_seconds)
        log.info("lamina serving %s as %s on http://%s:%d (max_model_len %d, %d KV blocks)", args.model,
                 names[0], args.host, sock.getsockname()[1], info.max_model_len, info.num_total_blocks)
        for i, pid in enumerate(getattr(state.engine, "pids", [])):
            log.info("data-parallel replica %d: engine core pid %d", i, pid)

    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_keep_alive=30,
                            http=head_timeout_protocol(args.http, args.header_timeout))
    server = GracefulServer(config, state.engine, args.shutdown_timeout, on_ready=ready)
    # Start-up objects (tokenizer, app, schemas) never die: out of the collector's sight, so its full
    # collections, which scan every tracked object, stop pausing the streams.
    gc.collect()
    gc.freeze()
    try:
        server.run(sockets=[sock])
    finally:
        state.engine.shutdown()  # idempotent; covers a start-up that failed before the app's lifespan ran
    log.info("lamina: shut down")
    return 0
