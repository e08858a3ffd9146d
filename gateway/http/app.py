"""The gateway's HTTP API: OpenAI's completions, chat and models; llama-server's extras."""

from __future__ import annotations

import dataclasses
import functools
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from loomserve.gateway.api.errors import APIError, install_handlers, invalid_request, unavailable
from loomserve.gateway.api.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingList,
    EmbeddingRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    ModelStatus,
    TokenizeRequest,
    TokenizeResponse,
    TokenPiece,
    streamed_responses,
)
from loomserve.gateway.config import DEFAULT_TENANT, GatewayConfig, PriorityRange
from loomserve.gateway.generate.assembly import Done, TokenLogprob
from loomserve.gateway.generate.group import GenerationGroup
from loomserve.gateway.generate.render import StreamChunks, response_body
from loomserve.gateway.generate.streaming import (
    EventStreamResponse,
    collect,
    event_stream,
    until_disconnect,
)
from loomserve.gateway.http.docs_pages import install_docs_pages
from loomserve.gateway.http.drain import Drain
from loomserve.gateway.http.embeddings import create_embeddings
from loomserve.gateway.http.http_protocol import limit_send_buffer
from loomserve.gateway.http.json_route import OffLoopJSONRoute
from loomserve.gateway.http.middleware import AccessMiddleware, BodyLimitMiddleware
from loomserve.gateway.http.ops import models_router, slots_router, status_router
from loomserve.gateway.metrics import GatewayMetrics
from loomserve.gateway.models.catalogue import Catalogue, ServedModel
from loomserve.gateway.models.manager import ManagerClient
from loomserve.gateway.models.registry import ModelEntry, Models
from loomserve.gateway.request import limits, prompts
from loomserve.gateway.request.generation_request import ApiBody, GenerationRequest, Prompt
from loomserve.gateway.request.params import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    max_new_tokens,
    reject_unsupported,
    request_priority,
    sampling_params,
    score_only,
    stop_strings,
    user_tenant,
)
from loomserve.gateway.tools.checks import ToolRequest, tool_request
from loomserve.gateway.translate.messages import messages_router
from loomserve.gateway.translate.responses import responses_router
from loomserve.gateway.workers.errors import WorkerClientError, WorkerLost
from loomserve.gateway.workers.pool import ModelWorkers, WorkerPool
from loomserve.protocol.messages import ModelInfo, SamplingParams

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


@dataclass(slots=True)
class Gateway:
    """What the routes share: settings, the models, the workers."""

    config: GatewayConfig
    models: Models  # which model a request names, and whether it can run now
    pool: WorkerPool  # every worker, of every model
    metrics: GatewayMetrics
    started_at: int
    drain: Drain = field(default_factory=Drain)  # SIGTERM: stop admitting, finish, exit

    def worker_info(self, model: str) -> ModelInfo:
        """The ModelInfo of the model's workers when one can take requests; 503 otherwise."""
        workers = self.workers(model)
        reason = workers.unavailable_reason()
        info = workers.info
        if reason or info is None:
            raise unavailable(reason or "not connected to the worker")
        return info

    def workers(self, model: str) -> ModelWorkers:
        """The workers a request for `model` may go to (every one, for the one-model gateway)."""
        if self.models.catalogue.only is not None:
            return self.pool.for_any()
        return self.pool.for_model(model)


def create_app(
    config: GatewayConfig,
    catalogue: Catalogue,
    pool: WorkerPool,
    metrics: GatewayMetrics,
    manager: ManagerClient | None = None,
) -> FastAPI:
    """The ASGI app; its lifespan connects the WorkerPool to the workers."""
    models = Models(config, catalogue, pool, manager, metrics)
    gateway = Gateway(config, models, pool, metrics, int(time.time()))
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
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # FastAPI's pages load their scripts from a CDN; docs_pages.py's do not
        redoc_url=None,
    )
    install_docs_pages(app)
    app.state.gateway = gateway
    install_handlers(app)
    app.include_router(_open_routes(gateway))
    app.include_router(status_router())  # a static page: its data comes from /slots
    checked = [Depends(_api_key_checker(config))]
    app.include_router(_api_routes(gateway), dependencies=checked)
    app.include_router(
        slots_router(pool), dependencies=checked, responses={401: ERROR_RESPONSES[401]}
    )
    app.include_router(
        models_router(models),
        dependencies=checked,
        responses={status: ERROR_RESPONSES[status] for status in (400, 401, 404, 409, 503)},
    )
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout=config.body_timeout
    )
    app.add_middleware(AccessMiddleware, metrics=metrics)
    if config.allowed_origins:
        # Outermost, so that errors (401, 413) carry the headers too and a browser shows them.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "Retry-After"],
            max_age=600,
        )
    return app


def _api_key_checker(config: GatewayConfig) -> Callable[[Request], None]:
    keys = [(key.encode(), key) for key in config.api_keys]

    def check_api_key(request: Request) -> None:
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not token and "x-api-key" in request.headers:  # Anthropic's clients send it so
            scheme, token = "bearer", request.headers["x-api-key"]
        given = token.strip().encode()
        # Every key is compared, so the time taken says nothing about which one matched.
        matched = [key for encoded, key in keys if hmac.compare_digest(given, encoded)]
        if scheme.lower() == "bearer" and matched:
            request.state.tenant = config.api_keys[matched[0]]  # fair shares, metrics
            request.state.priorities = config.key_priorities.get(matched[0])
        else:
            raise APIError(
                401,
                "missing or invalid API key; send it as 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>')",
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
        503 also while the gateway drains on its way down.
        """
        gateway.pool.note_rotation()
        reason = gateway.models.can_serve()
        if gateway.drain.draining:
            reason = "the gateway is shutting down"
        if reason:
            return unavailable(reason).response()
        load = gateway.pool.load
        ready, known = gateway.pool.counts()
        body: dict[str, Any] = {"status": "ok", "workers_ready": ready, "workers": known}
        if load is not None:
            body |= {
                "slots_idle": load.free_slots,
                "slots_processing": load.running,
                "queue_depth": load.queue_depth,
            }
        entries = gateway.models.entries()
        if len(entries) > 1 or gateway.models.manager is not None:
            body["models"] = {entry.name: entry.state for entry in entries}
        return JSONResponse(body)

    @router.get("/live", tags=["probes"])
    async def live() -> dict[str, str]:
        """200 whenever the gateway process runs."""
        return {"status": "ok"}

    @router.get("/metrics", tags=["probes"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics (of every gateway on this host in multiprocess mode)."""
        gateway.models.export_metrics()
        content, content_type = gateway.metrics.render()
        return Response(content, media_type=content_type)

    return router


# --- the API ----------------------------------------------------------------------


def _api_routes(gateway: Gateway) -> APIRouter:
    router = APIRouter(responses=ERROR_RESPONSES, route_class=OffLoopJSONRoute)
    models = gateway.models

    def model_card(entry: ModelEntry) -> ModelCard:
        return ModelCard(
            id=entry.name,
            created=gateway.started_at,
            max_model_len=entry.info.slot_context if entry.info is not None else None,
            status=ModelStatus(value=entry.state),
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
        return await _generate(gateway, http, body)

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
        return await _generate(gateway, http, body)

    @router.post("/v1/embeddings", tags=["openai"], response_model=EmbeddingList)
    async def embeddings(body: EmbeddingRequest, http: Request) -> Response:
        """Embeddings of the inputs: for a model with a pooling head, or with `--embeddings`."""
        served = await models.get(body.model)
        workers = gateway.workers(served.name)
        work = create_embeddings(workers, body, served.vocab, served.name)
        result = await until_disconnect(http, work)
        if result is None:
            return Response(status_code=499)  # nobody is listening any more
        return JSONResponse(result)

    @router.post("/tokenize", tags=["llama.cpp"])
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """Token ids of `content` (with their pieces when `with_pieces`), as llama-server."""
        vocab = (await models.get(body.model, worker=False)).vocab
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
    run = functools.partial(_generate, gateway)
    count = functools.partial(_prompt_tokens, gateway)
    for extra in (responses_router, messages_router):
        router.include_router(
            extra(
                run,
                count,
                models.name_of,
                responses=ERROR_RESPONSES,
                route_class=OffLoopJSONRoute,
            )
        )
    return router


async def _prompt_tokens(gateway: Gateway, body: ChatCompletionRequest) -> int:
    """The prompt's token count of a chat request: template, tools and all."""
    served = await gateway.models.get(body.model, worker=False)

    # No text cap here: counting is the question, even for a prompt no context holds.
    def count() -> int:
        tools = tool_request(body, served.template_tools, served.vocab)
        definitions = tools.definitions if tools else None
        tokens = prompts.chat_prompt(
            served.vocab, served.template, body.messages, served.template_tools, definitions
        )
        return len(tokens)

    return await prompts.in_thread(count)


# --- running a request ------------------------------------------------------------


async def _generate(gateway: Gateway, http: Request, body: ApiBody) -> Response:
    """Check the request, run it in the worker, answer as one body or as a stream."""
    if gateway.drain.draining:
        raise _shutting_down()
    arrived = time.monotonic()  # a request that waits for its model to load counts that
    served = await gateway.models.get(body.model)
    request = await _prepare(
        gateway,
        served,
        body,
        arrived,
        http.state.request_id,
        getattr(http.state, "tenant", None),
        getattr(http.state, "priorities", None),
    )
    log.debug(
        "request",
        response_id=request.id,
        choices=request.n_choices,
        prompt_tokens=[len(p.tokens) for p in request.prompts],
        max_tokens=[p.params.max_tokens for p in request.prompts],
    )
    if request.stream:
        return await _stream(gateway, served, http, request)
    running = await _NonStreamed.start(gateway, served, request)
    try:
        outcome = await until_disconnect(http, running.collect())
    finally:
        running.close()
    if outcome is None:
        return Response(status_code=499)  # nobody is listening any more
    texts, dones, logprobs = outcome
    answer = response_body(request, texts, dones, logprobs, running.group.usage())
    return JSONResponse(answer.model_dump())


async def _start_group(
    gateway: Gateway, served: ServedModel, request: GenerationRequest
) -> GenerationGroup:
    """Every choice of the request submitted, and tracked for draining."""
    pieces = served.tool_pieces if request.tools else served.vocab
    workers = gateway.workers(served.name)
    group = await GenerationGroup.start(workers, pieces, request, gateway.metrics)
    gateway.drain.track(group)
    return group


def _close_group(gateway: Gateway, group: GenerationGroup) -> None:
    group.close()
    gateway.drain.untrack(group)


async def _stream(
    gateway: Gateway, served: ServedModel, http: Request, request: GenerationRequest
) -> Response:
    """The request as server-sent events; the 200 goes out with the first output, so an
    error before it gets its own status."""
    group = await _start_group(gateway, served, request)
    try:
        waited = await until_disconnect(http, group.first_outputs())
    except BaseException:
        _close_group(gateway, group)
        raise
    if not waited:  # the client left while it waited
        _close_group(gateway, group)
        return Response(status_code=499)
    # A client that stops reading must fill a small buffer, not megabytes of the kernel's,
    # before the gateway's own bound on its tokens (--stream-buffer-tokens) starts counting.
    limit_send_buffer(http.scope.get("state", {}))
    chunks = StreamChunks(request)
    return EventStreamResponse(
        event_stream(group, chunks), on_close=lambda: _close_group(gateway, group)
    )


@dataclass(slots=True)
class _NonStreamed:
    """A request answered as one body: its client has seen nothing until the end, so when a
    worker is lost mid-way the whole request runs once more, on another worker, within its
    deadline (a stream is re-sent only before its first token: see generation.py)."""

    gateway: Gateway
    served: ServedModel
    request: GenerationRequest
    group: GenerationGroup

    @classmethod
    async def start(
        cls, gateway: Gateway, served: ServedModel, request: GenerationRequest
    ) -> _NonStreamed:
        return cls(gateway, served, request, await _start_group(gateway, served, request))

    async def collect(self) -> tuple[list[str], list[Done], list[list[TokenLogprob]]]:
        try:
            return await collect(self.group)
        except WorkerLost as lost:
            deadline = self.request.arrived_at + self.gateway.config.request_timeout
            if self.gateway.drain.draining or time.monotonic() >= deadline:
                raise
            log.info("worker lost mid-way; request run again", reason=lost.message)
            _close_group(self.gateway, self.group)
            self.gateway.pool.count_reroute("lost")
            try:
                self.group = await _start_group(self.gateway, self.served, self.request)
            except WorkerClientError:
                raise lost from None  # the client hears why its request ended
            return await collect(self.group)

    def close(self) -> None:
        _close_group(self.gateway, self.group)


def _check_text(gateway: Gateway, served: ServedModel, body: ApiBody) -> None:
    """400 at once for text no context can hold, before a thread renders and tokenizes it."""
    info = gateway.workers(served.name).info
    if info is None:
        return  # worker_info() answers 503 soon enough
    if isinstance(body, ChatCompletionRequest):
        chars, param = limits.chat_chars(body.messages), "messages"
    else:
        chars, param = limits.prompt_chars(body.prompt), "prompt"
    limits.check_text(chars, info.slot_context, served.vocab.longest_token, param)


def _build(
    served: ServedModel, body: ApiBody
) -> tuple[SamplingParams, ToolRequest | None, list[tuple[list[int], str]]]:
    """The request's sampling parameters, tools and prompts (token ids, echo text).

    Runs in a thread: a JSON schema's grammar, the tools' grammar, the chat template and
    the tokenizer are where a big request spends its time."""
    vocab = served.vocab
    params = sampling_params(body, 1, vocab, served.sampling_defaults)
    if not isinstance(body, ChatCompletionRequest):
        return params, None, prompts.completion_prompts(vocab, body.prompt, bool(body.echo))
    tools = tool_request(body, served.template_tools, vocab)
    if tools is not None and tools.grammar:
        params.grammar = tools.grammar
    tokens = prompts.chat_prompt(
        vocab,
        served.template,
        body.messages,
        served.template_tools,
        tools.definitions if tools else None,
    )
    return params, tools, [(tokens, "")]


def _shutting_down() -> APIError:
    error = unavailable("the gateway is shutting down; retry the request", code="shutting_down")
    error.headers = {**(error.headers or {}), "Connection": "close"}
    return error


async def _prepare(
    gateway: Gateway,
    served: ServedModel,
    body: ApiBody,
    arrived: float,
    request_id: str,
    key_tenant: str | None = None,
    key_priorities: PriorityRange | None = None,
) -> GenerationRequest:
    """The GenerationRequest of a body; every 4xx the gateway can tell by itself comes here.

    The tenant is the authorising API key's, else the body's `user`, else the shared one.
    The priority is the body's, clamped into what the key may claim.
    """
    reject_unsupported(body)
    stops = stop_strings(body.stop)
    _check_text(gateway, served, body)
    # Grammars, the template and the tokenizer: seconds for a big request, in a thread.
    built = await prompts.in_thread(functools.partial(_build, served, body))
    params, tools, texts = built
    if isinstance(body, ChatCompletionRequest):
        requested = body.max_completion_tokens
        if requested is None:
            requested = body.max_tokens
        default, id_prefix = None, "chatcmpl"
    else:
        requested, default, id_prefix = body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "cmpl"
        if score_only(body):  # the worker generates at least one token: the gateway drops it
            requested = 1
    n = body.n or 1
    if len(texts) * n > MAX_CHOICES:
        raise invalid_request(f"at most {MAX_CHOICES} choices (prompts × n) per request", "n")
    info = gateway.worker_info(served.name)
    request_prompts = []
    for tokens, text in texts:
        limit = max_new_tokens(requested, default, len(tokens), info.slot_context)
        own = dataclasses.replace(params, max_tokens=limit)
        request_prompts.append(Prompt(tokens=tokens, params=own, text=text))
    priority = request_priority(body.priority)
    if key_priorities is not None:
        priority = key_priorities.clamp(priority)
    response_id = f"{id_prefix}-{request_id}"
    if gateway.pool.in_use(response_id) or gateway.pool.in_use(f"{response_id}-0"):
        raise APIError(
            409,
            f"a request with X-Request-Id {request_id!r} is still running",
            code="duplicate_request_id",
        )
    return GenerationRequest(
        id=response_id,
        body=body,
        prompts=request_prompts,
        n=n,
        stops=stops,
        model=served.name,
        arrived_at=arrived,
        created=int(time.time()),
        tools=tools,
        score_only=score_only(body),
        priority=priority,
        tenant=key_tenant or user_tenant(body.user) or DEFAULT_TENANT,
    )
