"""`lamina serve [MODEL]`: load the engine, then serve the OpenAI-compatible API with uvicorn."""
from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger("lamina.server")


def add_serve_parser(sub) -> None:
    from lamina.cli import add_engine_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p, positional_model=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the API answers to (default: the model argument); the first is reported")
    p.add_argument("--api-key", default=os.environ.get("LAMINA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize "
                        "(default: $LAMINA_API_KEY, or no key)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are "
                        "aborted (default: 30)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=cmd_serve)


def _interrupt(sig: int, frame) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import time

    import uvicorn

    from lamina.cli import engine_kwargs
    from lamina.config import EngineConfig
    from lamina.server.app import build_app, make_state
    from lamina.server.graceful import GracefulServer

    t0 = time.monotonic()
    if args.shutdown_timeout < 0:
        log.error("--shutdown-timeout must be >= 0")
        return 2
    names = args.served_model_name or [args.model]
    # The engine core process loads the model before the port is bound, so /health answering means ready.
    # A signal during loading ends it quietly (the core process goes with make_state's clean-up).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        state = make_state(EngineConfig(**engine_kwargs(args)), names, args.api_key)
    except (RuntimeError, ValueError) as e:
        log.error("lamina serve: %s", e)
        return 1
    except KeyboardInterrupt:
        log.warning("lamina serve: interrupted during start-up")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    app = build_app(state)
    info = state.engine.info

    def ready() -> None:
        log.info("start-up: server ready in %.2f s (engine core pid %d, its start-up %.2f s)",
                 time.monotonic() - t0, info.pid, info.startup_seconds)
        log.warning("lamina serving %s as %s on http://%s:%d (max_model_len %d, %d KV blocks)", args.model,
                    names[0], args.host, args.port, info.max_model_len, info.num_total_blocks)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_keep_alive=30)
    server = GracefulServer(config, state.engine, args.shutdown_timeout, on_ready=ready)
    try:
        server.run()
    finally:
        state.engine.shutdown()  # idempotent; covers a start-up that failed before the app's lifespan ran
    log.warning("lamina: shut down")
    return 0
