"""ChatServing: a completions or chat body run on its model's workers, answered as one body
or as server-sent events. The Responses and Messages APIs run through it too (translate/).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import structlog
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ...protocol.messages import ModelInfo
from ..api.errors import APIError, invalid_request, unavailable
from ..api.schemas import ChatCompletionRequest
from ..config import GatewayConfig
from ..generate.assembly import Done, TokenLogprob
from ..generate.group import GenerationGroup
from ..generate.render import StreamChunks, response_body
from ..generate.streaming import (
    EventStreamResponse,
    collect,
    event_stream,
    limit_send_buffer,
    until_disconnect,
)
from ..metrics import GatewayMetrics
from ..models.catalogue import ServedModel
from ..models.registry import Models
from ..request import images, limits, prompts, thinking
from ..request.generation_request import ApiBody, GenerationRequest
from ..tools.checks import tool_request
from ..workers.errors import WorkerClientError, WorkerLost
from ..workers.pool import ModelWorkers, WorkerPool
from . import builder
from .builder import Caller
from .drain import Drain

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class ChatServing:
    """The chat path: check a body, run it on the workers of its model, answer."""

    config: GatewayConfig
    models: Models  # which model a request names, and whether it can run now
    pool: WorkerPool  # every worker, of every model
    metrics: GatewayMetrics
    drain: Drain = field(default_factory=Drain)  # SIGTERM: stop admitting, finish, exit

    # --- what the routes call -----------------------------------------------------

    async def generate(self, http: Request, body: ApiBody) -> Response:
        """Check the request, run it in the worker, answer as one body or as a stream."""
        if self.drain.draining:
            raise shutting_down()
        arrived = time.monotonic()  # a request that waits for its model to load counts that
        served = await self.models.get(body.model)
        request = await self._prepare(served, body, _caller(http), arrived)
        log.debug(
            "request",
            response_id=request.id,
            choices=request.n_choices,
            prompt_tokens=[len(p.tokens) for p in request.prompts],
            max_tokens=[p.params.max_tokens for p in request.prompts],
        )
        if request.stream:
            return await self._stream(served, http, request)
        running = await _NonStreamed.start(self, served, request)
        try:
            outcome = await until_disconnect(http, running.collect())
        finally:
            running.close()
        if outcome is None:
            return Response(status_code=499)  # nobody is listening any more
        texts, dones, logprobs, reasonings = outcome
        usage = running.group.usage()
        answer = response_body(request, texts, dones, logprobs, usage, reasonings)
        return JSONResponse(answer.model_dump())

    async def count_prompt_tokens(self, body: ChatCompletionRequest) -> int:
        """The prompt's token count of a chat request: template, tools and all; a vision
        model's images count the positions its worker's projector gives them."""
        served = await self.models.get(body.model, worker=False)
        # Counting a prompt longer than a slot is fine; megabytes no context holds are not.
        self.check_count_text(served, limits.chat_chars(body.messages), "messages")
        # Images: a worker's projector says how many positions each takes (it reads them).
        chat_images = await self._images(served, body, None) if _has_images(body) else None

        def count() -> int:
            tools = tool_request(body, served.template_tools, served.vocab)
            text = prompts.chat_text(
                served.template,
                body.messages,
                served.template_tools,
                tools.definitions if tools else None,
                thinking.template_kwargs(body, served.template_kwargs),
                images=chat_images is not None,
            )
            if chat_images:
                return len(images.image_tokens(served.vocab, text, len(chat_images))[0])
            return len(prompts.chat_tokens(served.vocab, text))

        tokens = await prompts.in_thread(count)
        if chat_images:
            tokens += sum(await self._image_tokens(served, chat_images))
        return tokens

    async def _image_tokens(self, served: ServedModel, chat_images: list[bytes]) -> list[int]:
        """Each image's prompt positions, from one of the model's workers; a 400 for an
        image its projector cannot read."""
        picked = self.workers(served.name).pick(None)
        if picked is None:
            raise unavailable("no worker of the model can count its images now")
        answer = await picked[0].image_tokens(chat_images, self.config.request_timeout)
        if answer.error or len(answer.counts) != len(chat_images):
            raise invalid_request(
                answer.error or "the worker did not count every image", "messages"
            )
        return answer.counts

    def check_count_text(self, served: ServedModel, chars: int, param: str) -> None:
        """400 (context_length_exceeded) for a count-only request's text that surely makes
        more tokens than the model's context (limits.count_context), before any tokenizing:
        tokenizing megabytes would hold the gateway for seconds."""
        info = self.workers(served.name).info
        context = limits.count_context(
            served.vocab.context_train, info.slot_context if info is not None else None
        )
        if context:
            limits.check_text(chars, context, served.vocab.longest_token, param)

    def model_name(self, requested: str | None) -> str:
        """The served name of a request's `model` (None: the default model's); 404 for one
        nobody serves."""
        return self.models.name_of(requested)

    def workers(self, model: str) -> ModelWorkers:
        """The workers a request for `model` may go to (every one, for the one-model gateway)."""
        if self.models.catalogue.only is not None:
            return self.pool.for_any()
        return self.pool.for_model(model)

    def worker_info(self, model: str) -> ModelInfo:
        """The ModelInfo of the model's workers when one can take requests; 503 otherwise."""
        workers = self.workers(model)
        reason = workers.unavailable_reason()
        info = workers.info
        if reason or info is None:
            raise unavailable(reason or "not connected to the worker")
        return info

    # --- running one --------------------------------------------------------------------

    async def _prepare(
        self, served: ServedModel, body: ApiBody, caller: Caller, arrived: float
    ) -> GenerationRequest:
        """The GenerationRequest of a body; every 4xx the gateway can tell by itself comes here.

        The tenant is the authorising API key's, else the body's `user`, else the shared one.
        The priority is the body's, clamped into what the key may claim.
        """
        info = self.workers(served.name).info
        builder.check_body(body, served, info.slot_context if info is not None else None)
        chat_images = await self._images(served, body, info)
        # Grammars, the template and the tokenizer: seconds for a big request, in a thread.
        if builder.drafts_inline(body, caller.body_bytes) and not chat_images:
            drafted = builder.draft(served, body, chat_images)
        else:
            work = functools.partial(builder.draft, served, body, chat_images)
            drafted = await prompts.in_thread(work)
        slot_context = self.worker_info(served.name).slot_context
        request = builder.build(served, body, drafted, slot_context, caller, arrived)
        if self.pool.in_use(request.id) or self.pool.in_use(f"{request.id}-0"):
            raise APIError(
                409,
                f"a request with X-Request-Id {caller.request_id!r} is still running",
                code="duplicate_request_id",
            )
        return request

    async def _images(
        self, served: ServedModel, body: ApiBody, info: ModelInfo | None
    ) -> list[bytes] | None:
        """A vision model's chat's images, read and checked in a thread (base64, fetches);
        None for a model that reads none, whose image parts are a 400 naming the part."""
        if not isinstance(body, ChatCompletionRequest):
            return None
        if info is None:
            info = self.worker_info(served.name)  # 503: no worker to say what it reads
        if not info.vision:
            images.refuse_images(body.messages, served.name)
            return None
        if not images.image_parts(body.messages):
            return []
        config = self.config
        limits = images.ImageLimits(
            config.max_image_bytes,
            config.max_image_side,
            tuple(domain.lower() for domain in config.allowed_media_domains),
            config.media_fetch_timeout,
            config.media_path,
        )
        return await prompts.in_thread(lambda: images.load_images(body.messages, limits))

    async def _start_group(
        self, served: ServedModel, request: GenerationRequest
    ) -> GenerationGroup:
        """Every choice of the request submitted, and tracked for draining."""
        pieces = served.pieces(bool(request.tools)) if request.chat else served.vocab
        workers = self.workers(served.name)
        group = await GenerationGroup.start(workers, pieces, request, self.metrics)
        self.drain.track(group)
        return group

    def _close_group(self, group: GenerationGroup) -> None:
        group.close()
        self.drain.untrack(group)

    async def _stream(
        self, served: ServedModel, http: Request, request: GenerationRequest
    ) -> Response:
        """The request as server-sent events; the 200 goes out with the first output, so an
        error before it gets its own status."""
        group = await self._start_group(served, request)
        try:
            waited = await until_disconnect(http, group.first_outputs())
        except BaseException:
            self._close_group(group)
            raise
        if not waited:  # the client left while it waited
            self._close_group(group)
            return Response(status_code=499)
        # A client that stops reading must fill a small buffer, not megabytes of the kernel's,
        # before the gateway's own bound on its tokens (--stream-buffer-tokens) starts counting.
        limit_send_buffer(http.scope.get("state", {}))
        chunks = StreamChunks(request)
        return EventStreamResponse(
            event_stream(group, chunks),
            on_close=lambda: self._close_group(group),
            prompt_tokens=sum(len(prompt.tokens) for prompt in request.prompts),
        )


@dataclass(slots=True)
class _NonStreamed:
    """A request answered as one body: its client has seen nothing until the end, so when a
    worker is lost mid-way the whole request runs once more, on another worker, within its
    deadline (a stream is re-sent only before its first token: see generation.py)."""

    serving: ChatServing
    served: ServedModel
    request: GenerationRequest
    group: GenerationGroup

    @classmethod
    async def start(
        cls, serving: ChatServing, served: ServedModel, request: GenerationRequest
    ) -> _NonStreamed:
        return cls(serving, served, request, await serving._start_group(served, request))

    async def collect(
        self,
    ) -> tuple[list[str], list[Done], list[list[TokenLogprob]], list[str]]:
        try:
            return await collect(self.group)
        except WorkerLost as lost:
            serving = self.serving
            deadline = self.request.arrived_at + serving.config.request_timeout
            if serving.drain.draining or time.monotonic() >= deadline:
                raise
            log.info("worker lost mid-way; request run again", reason=lost.message)
            serving._close_group(self.group)
            serving.pool.count_reroute("lost")
            try:
                self.group = await serving._start_group(self.served, self.request)
            except WorkerClientError:
                raise lost from None  # the client hears why its request ended
            return await collect(self.group)

    def close(self) -> None:
        self.serving._close_group(self.group)


def _caller(http: Request) -> Caller:
    """Who sent it, as the access and auth middleware left it on the request's state."""
    state = http.state
    length = http.headers.get("content-length", "")  # digits only: BodyLimitMiddleware
    return Caller(
        state.request_id,
        getattr(state, "tenant", None),
        getattr(state, "priorities", None),
        int(length) if length.isdigit() else None,
    )


def shutting_down() -> APIError:
    error = unavailable("the gateway is shutting down; retry the request", code="shutting_down")
    error.headers = {**(error.headers or {}), "Connection": "close"}
    return error


def _has_images(body: ChatCompletionRequest) -> bool:
    return bool(images.image_parts(body.messages))
