"""The FastAPI app: OpenAI-compatible routes, vLLM's /tokenize and /detokenize, /health and /metrics."""
from __future__ import annotations

import copy
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lamina.config import EngineConfig
from lamina.engine.async_engine import AsyncEngine
from lamina.engine.engine import LLMEngine
from lamina.server.anthropic import AnthropicRoute, count_tokens, create_message
from lamina.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from lamina.server.chat import chat_prompt, create_chat_completion
from lamina.server.completions import create_completion
from lamina.server.errors import APIError, bad_request, install_error_handlers
from lamina.server.limits import BodyLimits
from lamina.server.metrics import ServerMetrics
from lamina.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_continue,
)
from lamina.server.response_store import ResponseStore
from lamina.server.responses import ModelCard, ModelList
from lamina.server.responses_api import create_response, delete_response, get_response
from lamina.server.responses_protocol import ResponsesRequest
from lamina.server.serving import ServerState


@dataclass
class ServerOptions:
    """HTTP-level limits and switches of the app (the header timeout lives in the HTTP protocol)."""

    max_body_bytes: int = 4 * 2**20  # larger request bodies get a 413
    body_timeout: float = 30.0  # seconds to receive a body once its headers are in (then a 408)
    enable_docs: bool = False  # /docs, /redoc, /openapi.json (behind the API key when there is one)
    responses_store_size: int = 0  # Responses API: how many stored responses to keep (0: stateless)


def make_state(engine: LLMEngine | EngineConfig, model_names: list[str], api_key: str | None = None,
               sampling_defaults: dict[str, Any] | None = None, prompt_tokens_details: bool = False,
               data_parallel_size: int = 1) -> ServerState:
    """Wraps an engine for serving. An EngineConfig gets an engine core process of its own, started here (it
    loads the model while this process loads the tokenizer; returns once the core is ready): what `lamina
    serve` does. An LLMEngine built in this process is served by a core thread that starts with the app
    (lifespan): for tests, which reach inside it. sampling_defaults: the model's generation-config defaults
    for fields a request leaves unset. data_parallel_size N > 1 (an EngineConfig only): N core processes behind
    one client (engine/dp_client.py)."""
    metrics = ServerMetrics(model_names[0])
    if isinstance(engine, EngineConfig):
        if data_parallel_size > 1:
            from lamina.engine.dp_client import DPClient

            client = DPClient.spawn(engine, data_parallel_size, observer=metrics, registry=metrics.registry,
                                    model_name=model_names[0], wait=False)
        else:
            client = AsyncEngine.spawn(engine, observer=metrics, wait=False)
        try:
            tokenizer = load_engine_tokenizer(engine)
            client.set_tokenizer(tokenizer)  # outputs are decoded on the client's side (a copy of its own)
            client.wait_ready()
        except BaseException:
            client.shutdown(timeout=5)
            raise
        info = client.info
        metrics.set_cache_config(engine.block_size, info.num_total_blocks, engine.enable_prefix_caching)
        return ServerState(engine=client, tokenizer=tokenizer, model_names=model_names, model_root=engine.model,
                           max_model_len=info.max_model_len, vocab_size=info.vocab_size, metrics=metrics,
                           api_key=api_key, sampling_defaults=dict(sampling_defaults or {}),
                           prompt_tokens_details=prompt_tokens_details)
    metrics.set_cache_config(engine.config.block_size, engine.allocator.num_blocks, engine.config.enable_prefix_caching)
    return ServerState(engine=AsyncEngine(engine, observer=metrics), tokenizer=copy.deepcopy(engine.tokenizer),
                       model_names=model_names, model_root=engine.config.model, max_model_len=engine.max_model_len,
                       vocab_size=engine.model_config.vocab_size, metrics=metrics, api_key=api_key,
                       sampling_defaults=dict(sampling_defaults or {}), prompt_tokens_details=prompt_tokens_details)


def load_engine_tokenizer(config: EngineConfig):
    """The tokenizer the engine of `config` uses, loaded in this process (None for `random:` models)."""
    from lamina.models.loader import engine_tokenizer

    return engine_tokenizer(config)


class _ErrorCounter:
    """Counts error responses for /metrics. Plain ASGI: Starlette's BaseHTTPMiddleware would get between
    StreamingResponse and the disconnect it listens for."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.metrics.on_http_error(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


def build_app(state: ServerState, options: ServerOptions | None = None) -> FastAPI:
    options = options or ServerOptions()
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.shutdown()

    # The generated docs describe every route and field: off unless asked for (then behind the key, below).
    app = FastAPI(title="lamina", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.lamina = state
    install_error_handlers(app)
    app.add_middleware(BodyLimits, max_bytes=options.max_body_bytes, timeout=options.body_timeout)
    app.add_middleware(_ErrorCounter, metrics=state.metrics)  # outermost: counts the 413s and 408s too

    async def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":  # Anthropic's clients send the key as x-api-key
            token = request.headers.get("x-api-key", "")
        if not secrets.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError("Incorrect API key provided.", 401, code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.engine.is_running else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @api.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=state.model_root, max_model_len=state.max_model_len)
                               for name in state.model_names])

    @api.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(req, raw, state)

    @api.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(req, raw, state)

    store = ResponseStore(options.responses_store_size)  # this app's; several apps may share a process

    @api.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request) -> Response:
        return await create_response(req, raw, state, store)

    @api.get("/v1/responses/{response_id}")
    async def responses_get(response_id: str) -> Response:
        return get_response(store, response_id)

    @api.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str) -> Response:
        return delete_response(store, response_id)

    @api.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must not be empty", "messages")
            check_continue(req.add_generation_prompt, req.continue_final_message, req.messages)
            ids = chat_prompt(state, [{"role": m.role, "content": m.text()} for m in req.messages],
                              req.add_generation_prompt, continue_final_message=req.continue_final_message)
        else:
            ids = state.encode(req.prompt, req.add_special_tokens)
        strs = state.need_tokenizer("return_token_strs").convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @api.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        state.check_model(req.model)
        tokenizer = state.need_tokenizer("tokens")
        if not all(0 <= t < state.vocab_size for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {state.vocab_size})", "tokens")
        return JSONResponse({"prompt": tokenizer.decode(req.tokens)})

    if options.enable_docs:
        _add_docs(app, api)
    app.include_router(api)
    app.include_router(_anthropic_routes(state, check_key))
    return app


def _anthropic_routes(state: ServerState, check_key) -> APIRouter:
    """Anthropic's Messages API; its errors take Anthropic's shape (AnthropicRoute)."""
    router = APIRouter(dependencies=[Depends(check_key)], route_class=AnthropicRoute)

    @router.post("/v1/messages")
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        return await create_message(req, raw, state)

    @router.post("/v1/messages/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest) -> Response:
        return await count_tokens(req, state)

    return router


def _add_docs(app: FastAPI, api: APIRouter) -> None:
    """/openapi.json, /docs and /redoc on the keyed router (open when the server has no key)."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @api.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="lamina")

    @api.get("/redoc", include_in_schema=False)
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title="lamina")
