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
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from lamina.cli import engine_kwargs
    from lamina.config import EngineConfig
    from lamina.engine.engine import LLMEngine
    from lamina.server.app import build_app, make_state

    # Load before binding the port, so /health answering means the model is ready.
    engine = LLMEngine(EngineConfig(**engine_kwargs(args)), progress=False)
    names = args.served_model_name or [args.model]
    app = build_app(make_state(engine, names, args.api_key))
    log.warning("lamina serving %s as %s on http://%s:%d (max_model_len %d, %d KV blocks)", args.model,
                names[0], args.host, args.port, engine.max_model_len, engine.stats().num_total_blocks)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_keep_alive=30)
    return 0
