"""The FastAPI application: OpenAI's chat and completion endpoints (:mod:`.endpoints`), the
models, health and metrics routes, vLLM's tokenize routes (:mod:`.tokenize`), llama-server's
routes (:mod:`.infill`), Anthropic's Messages API (:mod:`.anthropic`), OpenAI's Responses API
(:mod:`.responses`), Ollama's API (:mod:`.ollama`), OpenAI-shaped errors, and the middleware in
front of them (the Host check, CORS, a count of every request).

A request is checked completely before it takes a place in the queue (Host header, content
type, body size, JSON, schema, method and config against the server's limits, prompt length
against the context: first from its size, then from its tokens), so bad input costs no model
time and gets OpenAI's error object with a 4xx; docs/server.md lists what a hostile client
meets. Generation runs on the backend of the front end (:mod:`.frontend`): the local
scheduler thread (:class:`Server`), or Ray Serve engine replicas (:mod:`.ray_serve`, the same
routes in front of them); its events come back through an ``asyncio.Queue`` and leave as one
JSON body or as server-sent events (``data: {...}`` ... ``data: [DONE]``).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode import registry
from specdecode.server.anthropic import add_anthropic_routes
from specdecode.server.diffusion import served_policies
from specdecode.server.endpoints import Endpoint
# Server and Settings: the library's way to run a server in-process (tests, scripts) is
# ``from specdecode.server.app import Server, Settings, create_app``
from specdecode.server.frontend import Frontend, Server, Settings
from specdecode.server.metrics import CONTENT_TYPE, Metrics
from specdecode.server.ollama import add_ollama_routes
from specdecode.server.protocol import ApiError, error_body
from specdecode.server.responses import add_responses_routes
from specdecode.server.infill import add_llama_routes
from specdecode.server.tokenize import add_tokenize_routes

__all__ = ["Server", "Settings", "create_app"]

log = logging.getLogger("specdecode.server")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
             "/tokenize", "/detokenize", "/v1/messages", "/v1/responses", "/api/chat",
             "/api/generate")


class CheckHost:
    """ASGI middleware: answer only requests whose Host header names this server (421
    otherwise), so a web page whose own name an attacker points at 127.0.0.1 (DNS rebinding)
    cannot reach a server on loopback."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app = app
        self.allowed = {h.lower() for h in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if host_name(host) not in self.allowed:
            response = JSONResponse(error_body(
                f"this server does not answer for host {ascii(host[:100])}; it answers "
                f"{', '.join(sorted(self.allowed))} (start it with --allowed-hosts to add names)",
                code="misdirected_request"), status_code=421)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def host_name(host: str) -> str:
    """'name:port' or '[v6]:port' -> the name, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class CountRequests:
    """ASGI middleware: count every HTTP request by endpoint and status code."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        status = {"code": 500}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()


def create_app(server: Frontend) -> FastAPI:
    """The ASGI app. On start-up the constraints' vocabulary is built (``Frontend.prepare``),
    then the scheduler starts. On shutdown the scheduler stops first (every proposer sees
    ``finish``), then the suffix global tree is saved (with ``--suffix-cache``)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app):
        await run_in_threadpool(server.prepare)
        server.backend.start()
        try:
            yield
        finally:
            await run_in_threadpool(server.backend.stop)
            await run_in_threadpool(server.memory.save)

    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    chat = Endpoint(server, chat=True)
    completion = Endpoint(server, chat=False)

    add_error_handlers(app)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat.handle(request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion.handle(request)

    add_tokenize_routes(app, server)
    add_llama_routes(app, server)
    add_anthropic_routes(app, chat)
    add_responses_routes(app, chat)
    add_ollama_routes(app, chat, completion)

    @app.get("/v1/models")
    async def models():
        served = registry.names() + (served_policies() if server.dllm is not None else [])
        ids = [server.settings.model_id] + [f"{server.settings.model_id}+{name}"
                                            for name in served]
        return {"object": "list", "data": [
            {"id": i, "object": "model", "created": server.started, "owned_by": "specdecode",
             "max_model_len": server.max_context} for i in ids]}

    @app.get("/health")
    async def health():
        alive = server.backend.alive
        body = {"status": "ok" if alive else "error", "model": server.settings.model_id,
                "method": server.settings.method, "max_context": server.max_context,
                **server.backend.load()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    add_middleware(app, server)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error answers in OpenAI's error shape, an unexpected one as a logged 500."""

    @app.exception_handler(ApiError)
    async def api_error(_request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc}", "server_error"), status_code=500)


def add_middleware(app: FastAPI, server: Frontend) -> None:
    settings = server.settings
    if settings.cors_origins:  # off by default: browsers then keep other origins' pages out
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-api-key",
                                          "anthropic-version", "anthropic-beta"], max_age=600)
    if settings.allowed_hosts is not None:
        app.add_middleware(CheckHost, allowed=settings.allowed_hosts)
    app.add_middleware(CountRequests, metrics=server.metrics)  # outermost: counts every answer
