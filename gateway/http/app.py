"""The gateway's HTTP API: OpenAI's completions, chat and models; llama-server's extras."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import structlog
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from .. import tracing
from ..api.errors import install_handlers, unavailable
from ..api.response_bodies import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    EmbeddingList,
    ErrorResponse,
    FailedModelStatus,
    ModelCard,
    ModelList,
    ModelStatus,
    TokenizeResponse,
    TokenPiece,
    UnavailableModelStatus,
    streamed_responses,
)
from ..api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from ..config import GatewayConfig
from ..generate.streaming import (
    until_disconnect,
)
from ..metrics import GatewayMetrics
from ..models.catalogue import Catalogue
from ..models.manager import ManagerClient
from ..models.registry import ModelEntry, Models
from ..request import prompts
from ..serving.chat import ChatServing
from ..translate.messages import messages_router
from ..translate.responses import responses_router
from ..workers.pool import WorkerPool
from .docs_pages import install_docs_pages
from .embeddings import create_embeddings
from .json_route import OffLoopJSONRoute
from .middleware import (
    AccessMiddleware,
    AuthMiddleware,
    BarePathMiddleware,
    BodyLimitMiddleware,
)
from .openapi_bounds import install_token_bounds
from .ops import models_router, slots_router, status_router
from .tracing import TracingMiddleware

log = structlog.get_logger(__name__)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in [
        (
            400,
            "Invalid request: a field the server cannot honour, more than 128 tools or 4096 "
            "messages, a prompt or max_tokens too long for the context, a grammar or tools' "
            "schemas that give no usable grammar",
        ),
        (401, "Missing or invalid API key"),
        (404, "Unknown model"),
        (408, "The request's headers or body came too slowly"),
        (409, "A request with this X-Request-Id is running; a busy model cannot be unloaded"),
        (413, "Request body too large"),
        (500, "The engine failed the request"),
        (502, "The worker's output for the request broke the protocol"),
        (503, "Worker busy (queue full), unavailable, or the gateway shutting down; Retry-After"),
        (504, "The request ran past the server's request timeout"),
    ]
}


def create_app(
    config: GatewayConfig,
    catalogue: Catalogue,
    pool: WorkerPool,
    metrics: GatewayMetrics,
    manager: ManagerClient | None = None,
) -> FastAPI:
    """The ASGI app; its lifespan connects the WorkerPool to the workers."""
    models = Models(config, catalogue, pool, manager, metrics)
    chat = ChatServing(config, models, pool, metrics)
    started_at = int(time.time())
    for name in catalogue.names():
        metrics.model_info.labels(model_name=name).set(1)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        if manager is not None:
            await manager.start()
        # Several gateways may share one port: do not take connections (and answer them
        # 503) before a worker has answered, unless they are slow to come. Under a model
        # manager no worker may be running at all: the models load on demand.
        if manager is None and not await pool.wait_for_worker(config.worker_timeout):
            log.warning(
                "no answer from the worker yet; answering 503 until it comes",
                reason=pool.unavailable_reason(),
            )
        try:
            yield
        finally:
            if manager is not None:
                await manager.close()
            await pool.close()

    app = FastAPI(
        title="loomserve gateway",
        summary="OpenAI-compatible completions over a continuous-batching llama.cpp worker.",
        # The package's own version: /openapi.json's info names the build serving (the
        # bench's server identity reads it).
        version=importlib.metadata.version("loomserve"),
        lifespan=lifespan,
        docs_url=None,  # FastAPI's pages load their scripts from a CDN; docs_pages.py's do not
        redoc_url=None,
        # FastAPI's own OpenTelemetry spans (since 0.165) would start a second server span
        # per request, beside http/tracing.py's, and trace every /health and /metrics poll;
        # older FastAPIs keep this as an extra setting and ignore it.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    install_docs_pages(app)
    install_token_bounds(app, chat.models.catalogue)
    app.state.chat = chat  # server.py drains it on SIGTERM
    install_handlers(app)
    app.include_router(_open_routes(chat))
    app.include_router(status_router())  # a static page: its data comes from /slots
    # Behind the API key, when keys are set (AuthMiddleware): all but probes, metrics, docs.
    app.include_router(_api_routes(chat, started_at))
    app.include_router(slots_router(pool), responses={401: ERROR_RESPONSES[401]})
    app.include_router(
        models_router(models),
        responses={status: ERROR_RESPONSES[status] for status in (400, 401, 404, 409, 503)},
    )
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout=config.body_timeout
    )
    # Outside the body limit (no key, no body read), inside the access log (401s counted).
    app.add_middleware(
        AuthMiddleware,
        tenants=config.api_keys,
        priorities=config.key_priorities,
        admins=config.admin_keys,
    )
    app.add_middleware(AccessMiddleware, metrics=metrics)
    app.add_middleware(BarePathMiddleware)  # outside the keys and the log: they see /v1 paths
    if config.otlp_endpoint is not None:
        tracing.enable()
        app.add_middleware(TracingMiddleware)  # outside the access middleware: sees the id
    if config.cors_origins:
        # Outermost, so that errors (401, 413) carry the headers too and a browser shows them.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "Retry-After"],
            max_age=600,
        )
    return app


# --- open routes: probes and metrics --------------------------------------------


def _open_routes(chat: ChatServing) -> APIRouter:
    router = APIRouter()

    @router.get("/health", tags=["probes"], responses={503: ERROR_RESPONSES[503]})
    async def health() -> JSONResponse:
        """200 while a worker is connected, heartbeating and serves our vocabulary; else 503.

        The slot counts are those of every worker in rotation, summed.
        503 also while the gateway drains on its way down.
        """
        chat.pool.note_rotation()
        reason = chat.models.can_serve()
        if chat.drain.draining:
            reason = "the gateway is shutting down"
        if reason:
            return unavailable(reason).response()
        load = chat.pool.load
        ready, known = chat.pool.counts()
        body: dict[str, Any] = {"status": "ok", "workers_ready": ready, "workers": known}
        if load is not None:
            body |= {
                "slots_idle": load.free_slots,
                "slots_processing": load.running,
                "queue_depth": load.queue_depth,
            }
        entries = chat.models.entries()
        if len(entries) > 1 or chat.models.manager is not None:
            body["models"] = {entry.name: entry.state for entry in entries}
        return JSONResponse(body)

    @router.get("/live", tags=["probes"])
    async def live() -> dict[str, str]:
        """200 whenever the gateway process runs."""
        return {"status": "ok"}

    @router.get("/metrics", tags=["probes"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics (of every gateway on this host in multiprocess mode)."""
        chat.models.export_metrics()
        content, content_type = chat.metrics.render()
        return Response(content, media_type=content_type)

    return router


# --- the API ----------------------------------------------------------------------


def _api_routes(chat: ChatServing, started_at: int) -> APIRouter:
    router = APIRouter(responses=ERROR_RESPONSES, route_class=OffLoopJSONRoute)
    models = chat.models

    def model_card(entry: ModelEntry) -> ModelCard:
        return ModelCard(
            id=entry.name,
            created=started_at,
            max_model_len=entry.info.slot_context if entry.info is not None else None,
            input_modalities=(
                None if entry.info is None else ["text", "image"] if entry.info.vision else ["text"]
            ),
            status=(
                FailedModelStatus(value=entry.state, reason=entry.reason)
                if entry.failed
                else UnavailableModelStatus(value=entry.state, reason=entry.reason)
                if entry.reason
                else ModelStatus(value=entry.state)
            ),
        )

    @router.get("/v1/models", tags=["openai"])
    async def list_models() -> ModelList:
        """Every model this server serves, loaded or not, with its state."""
        return ModelList(data=[model_card(entry) for entry in models.entries()])

    @router.get("/v1/models/{model:path}", tags=["openai"])
    async def model(model: str) -> ModelCard:
        """The model by its name; 404 for any other name."""
        return model_card(models.entry(models.name_of(model)))

    @router.post(
        "/v1/completions",
        tags=["openai"],
        response_model=Completion,
        responses=streamed_responses(
            "A completion; with `stream`, its chunks as server-sent events"
        ),
    )
    async def completions(body: CompletionRequest, http: Request) -> Response:
        """Text completion; streams server-sent events when `stream` is true."""
        return await chat.generate(http, body)

    @router.post(
        "/v1/chat/completions",
        tags=["openai"],
        response_model=ChatCompletion,
        responses=streamed_responses(
            "A chat completion; with `stream`, its chunks as server-sent events"
        ),
    )
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        """Chat completion through the model's chat template; streams when `stream` is true."""
        return await chat.generate(http, body)

    @router.post("/v1/embeddings", tags=["openai"], response_model=EmbeddingList)
    async def embeddings(body: EmbeddingRequest, http: Request) -> Response:
        """Embeddings of the inputs: for a model with a pooling head, or with `--embeddings`."""
        served = await models.get(body.model)
        workers = chat.workers(served.name)
        work = create_embeddings(workers, body, served.vocab, served.name)
        result = await until_disconnect(http, work)
        if result is None:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(result)

    @router.post("/tokenize", tags=["llama.cpp"])
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of `content` (with their pieces when `with_pieces`), as llama-server."""
        served = await models.get(body.model, worker=False)
        chat.check_count_text(served, len(body.content), "content")
        vocab = served.vocab
        tokens = await prompts.tokenize(vocab, body.content, body.add_special, body.parse_special)
        if body.with_pieces:
            pieces = await prompts.off_loop(len(tokens), lambda: [vocab.text_of(t) for t in tokens])
            return TokenizeResponse(
                tokens=[TokenPiece(id=t, piece=p) for t, p in zip(tokens, pieces, strict=True)]
            )
        return TokenizeResponse(tokens=tokens)

    @router.post("/detokenize", tags=["llama.cpp"])
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids, as llama-server."""
        vocab = (await models.get(body.model, worker=False)).vocab
        await prompts.off_loop(
            len(body.tokens), lambda: prompts.check_token_ids(vocab, body.tokens, "tokens")
        )
        text = await prompts.off_loop(len(body.tokens), lambda: vocab.detokenize(body.tokens))
        return DetokenizeResponse(content=text)

    # The Responses and Messages APIs: translations at the edge into the chat path.
    for extra in (responses_router, messages_router):
        router.include_router(extra(chat, responses=ERROR_RESPONSES, route_class=OffLoopJSONRoute))
    return router
