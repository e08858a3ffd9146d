"""The gateway's HTTP API: OpenAI's completions, chat and models; llama-server's extras."""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import structlog
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loomserve.gateway import prompts
from loomserve.gateway.chat_template import ChatTemplate
from loomserve.gateway.config import GatewayConfig
from loomserve.gateway.errors import APIError, install_handlers, unavailable
from loomserve.gateway.generation import Generation
from loomserve.gateway.metrics import GatewayMetrics
from loomserve.gateway.middleware import AccessMiddleware, BodyLimitMiddleware
from loomserve.gateway.params import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    max_new_tokens,
    reject_unsupported,
    sampling_params,
    stop_strings,
)
from loomserve.gateway.pool import WorkerPool
from loomserve.gateway.render import StreamChunks, response_body
from loomserve.gateway.request import ApiBody, GenerationRequest
from loomserve.gateway.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenPiece,
)
from loomserve.gateway.streaming import EventStreamResponse, collect, event_stream, until_disconnect
from loomserve.gateway.tokenizer import Vocab
from loomserve.protocol.messages import ModelInfo

log = structlog.get_logger(__name__)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in [
        (400, "Invalid request, or prompt too long for the context"),
        (401, "Missing or invalid API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (503, "Worker busy (queue full, with Retry-After) or unavailable"),
    ]
}


@dataclass(slots=True)
class Gateway:
    """What the routes share: settings, the vocabulary, the chat template, the workers."""

    config: GatewayConfig
    vocab: Vocab
    template: ChatTemplate
    client: WorkerPool  # every worker; it looks like one that is ready while any is
    metrics: GatewayMetrics
    started_at: int

    def worker_info(self) -> ModelInfo:
        """The worker's ModelInfo when it can take requests; 503 otherwise."""
        reason = self.client.unavailable_reason()
        if reason or self.client.info is None:
            raise unavailable(reason or "not connected to the worker")
        return self.client.info


def create_app(
    config: GatewayConfig, vocab: Vocab, client: WorkerPool, metrics: GatewayMetrics
) -> FastAPI:
    """The ASGI app; its lifespan connects the WorkerPool to the workers."""
    template = ChatTemplate.for_model(
        config.chat_template, vocab.chat_template, vocab.bos_text, vocab.eos_text
    )
    gateway = Gateway(config, vocab, template, client, metrics, int(time.time()))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        # Several gateways may share one port: do not take connections (and answer them
        # 503) before a worker has answered, unless they are slow to come.
        if not await client.wait_for_worker(config.worker_timeout):
            log.warning("no answer from the worker yet; answering 503 until it comes")
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(
        title="loomserve gateway",
        summary="OpenAI-compatible completions over a continuous-batching llama.cpp worker.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    install_handlers(app)
    app.include_router(_open_routes(gateway))
    app.include_router(_api_routes(gateway), dependencies=[Depends(_api_key_checker(config))])
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(AccessMiddleware, metrics=metrics)
    return app


def _api_key_checker(config: GatewayConfig) -> Callable[[Request], None]:
    keys = [key.encode() for key in config.api_keys]

    def check_api_key(request: Request) -> None:
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k) for k in keys):
            raise APIError(
                401,
                "missing or invalid API key; send it as 'Authorization: Bearer <key>'",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check_api_key


# --- open routes: probes and metrics --------------------------------------------


def _open_routes(gateway: Gateway) -> APIRouter:
    router = APIRouter()

    @router.get("/health", tags=["probes"], responses={503: ERROR_RESPONSES[503]})
    async def health() -> JSONResponse:
        """200 while a worker is connected, heartbeating and serves our vocabulary; else 503.

        The slot counts are those of every worker in rotation, summed.
        """
        reason = gateway.client.unavailable_reason()
        if reason:
            return unavailable(reason).response()
        beat = gateway.client.heartbeat
        ready, known = gateway.client.counts()
        body: dict[str, Any] = {"status": "ok", "workers_ready": ready, "workers": known}
        if beat is not None:
            body |= {
                "slots_idle": beat.free_slots,
                "slots_processing": beat.running,
                "queue_depth": beat.queue_depth,
            }
        return JSONResponse(body)

    @router.get("/live", tags=["probes"])
    async def live() -> dict[str, str]:
        """200 whenever the gateway process runs."""
        return {"status": "ok"}

    @router.get("/metrics", tags=["probes"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics (of every gateway on this host in multiprocess mode)."""
        content, content_type = gateway.metrics.render()
        return Response(content, media_type=content_type)

    return router


# --- the API ----------------------------------------------------------------------


def _api_routes(gateway: Gateway) -> APIRouter:
    router = APIRouter(responses=ERROR_RESPONSES)
    vocab = gateway.vocab

    @router.get("/v1/models", tags=["openai"])
    async def models() -> ModelList:
        """The one model this server runs."""
        info = gateway.client.info
        card = ModelCard(
            id=gateway.config.served_model_name,
            created=gateway.started_at,
            max_model_len=info.slot_context if info is not None else None,
        )
        return ModelList(data=[card])

    @router.post("/v1/completions", tags=["openai"], response_model=Completion)
    async def completions(body: CompletionRequest, http: Request) -> Response:
        """Text completion; streams server-sent events when `stream` is true."""
        return await _generate(gateway, http, body)

    @router.post("/v1/chat/completions", tags=["openai"], response_model=ChatCompletion)
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        """Chat completion through the model's chat template; streams when `stream` is true."""
        return await _generate(gateway, http, body)

    @router.post("/tokenize", tags=["llama.cpp"])
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of `content` (with their pieces when `with_pieces`), as llama-server."""
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
        prompts.check_token_ids(vocab, body.tokens, "tokens")
        text = await prompts.off_loop(len(body.tokens), lambda: vocab.detokenize(body.tokens))
        return DetokenizeResponse(content=text)

    return router


def _check_model(gateway: Gateway, model: str | None) -> None:
    name = gateway.config.served_model_name
    if model is not None and model != name:
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server runs `{name}`.",
            param="model",
            code="model_not_found",
        )


# --- running a request ------------------------------------------------------------


async def _generate(gateway: Gateway, http: Request, body: ApiBody) -> Response:
    """Check the request, run it in the worker, answer as one body or as a stream."""
    request = await _prepare(gateway, body)
    structlog.contextvars.bind_contextvars(request_id=request.id)
    log.debug("request", prompt_tokens=len(request.prompt), max_tokens=request.params.max_tokens)
    generation = await Generation.start(gateway.client, gateway.vocab, request, gateway.metrics)
    if request.stream:
        chunks = StreamChunks(request)
        return EventStreamResponse(event_stream(generation, chunks), on_close=generation.close)
    try:
        outcome = await until_disconnect(http, collect(generation))
    finally:
        generation.close()
    if outcome is None:
        return Response(status_code=499)  # nobody is listening any more
    text, done = outcome
    return JSONResponse(response_body(request, text, done).model_dump())


async def _prepare(gateway: Gateway, body: ApiBody) -> GenerationRequest:
    """The GenerationRequest of a body; every 4xx the gateway can tell by itself comes here."""
    arrived = time.monotonic()
    vocab = gateway.vocab
    _check_model(gateway, body.model)
    reject_unsupported(body)
    stops = stop_strings(body.stop)
    params = sampling_params(body, 1, vocab)
    if isinstance(body, ChatCompletionRequest):
        prompt = await prompts.chat_prompt(vocab, gateway.template, body.messages)
        requested = body.max_completion_tokens
        if requested is None:
            requested = body.max_tokens
        default, id_prefix = None, "chatcmpl"
    else:
        prompt = await prompts.completion_prompt(vocab, body.prompt)
        requested, default, id_prefix = body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "cmpl"
    info = gateway.worker_info()
    params.max_tokens = max_new_tokens(requested, default, len(prompt), info.slot_context)
    return GenerationRequest(
        id=f"{id_prefix}-{uuid.uuid4().hex}",
        body=body,
        prompt=prompt,
        params=params,
        stops=stops,
        model=gateway.config.served_model_name,
        arrived_at=arrived,
        created=int(time.time()),
    )
