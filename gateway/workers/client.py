"""WorkerClient: the gateway's DEALER socket to one worker, and the routing of its replies.

Each request gets a RequestHandle: a future for Accepted/Rejected and a queue of TokenChunk
and Finish messages. The client tracks the worker's liveness from every message it receives;
when the worker goes silent for worker_timeout, or its connection drops, every open request
ends with WorkerLost and the client says Hello again until a worker answers. A Generate
that the worker never confirmed is never sent again.

The client speaks the protocol only: it raises the transport errors of worker_errors, and
knows nothing of HTTP. With several workers there is one client per worker; pool.py owns them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar, cast

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from loomserve.gateway.config import GatewayConfig
from loomserve.gateway.metrics import GatewayMetrics
from loomserve.gateway.workers.curve import set_curve_client
from loomserve.gateway.workers.directory import ModelDirectory
from loomserve.gateway.workers.errors import (
    ReaderTooSlow,
    WorkerClientError,
    WorkerLost,
    WorkerRejected,
    WorkerTimeout,
    WorkerUnavailable,
)
from loomserve.gateway.workers.handshake import HANDSHAKE_FAILED, handshake_failure
from loomserve.protocol.codec import MAX_FRAME_BYTES, DecodeError, decode, encode
from loomserve.protocol.messages import (
    PROTOCOL_VERSION,
    Accepted,
    Cancel,
    Embed,
    Embeddings,
    ErrorCode,
    Finish,
    FinishReason,
    Generate,
    Heartbeat,
    Hello,
    Message,
    ModelInfo,
    Outputs,
    Ping,
    Rejected,
    SlotsQuery,
    SlotsReport,
    TokenChunk,
    VocabFile,
    VocabQuery,
    WorkerError,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

RequestEvent = TokenChunk | Finish
DISCONNECT_GRACE_SECONDS = 0.1  # for the last messages to reach the socket


@dataclass(slots=True)
class RequestHandle:
    """One request in the worker: its confirmation, then its tokens and its Finish."""

    request_id: str
    deadline: float  # time.monotonic() past which waiting for output raises WorkerTimeout
    # Accepted or Rejected; for an Embed, its Embeddings or Rejected
    accepted: asyncio.Future[Accepted | Rejected | Embeddings]
    events: asyncio.Queue[RequestEvent | WorkerClientError] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    buffered: int = 0  # tokens in `events` not read yet; bounded by stream_buffer_tokens
    # The reader waits for events now: what piles up meanwhile (a burst after this gateway
    # stalled) waits for the event loop, not for a client that stopped reading.
    reading: bool = False

    async def next_event(self) -> RequestEvent:
        """The next TokenChunk or Finish; raises WorkerLost or WorkerTimeout."""
        event = await self._get()
        if isinstance(event, WorkerClientError):
            raise event
        self._taken(event)
        return event

    async def next_events(self) -> list[RequestEvent]:
        """Everything that arrived since the last call, waiting for at least one event.

        Taking the whole backlog at once keeps a reader that fell behind from looping
        without ever yielding to the event loop (and so from missing its client's disconnect).
        An error comes last in the queue: the events before it are handed out first, and
        the next call raises it.
        """
        events = [await self.next_event()]
        while not self.events.empty():
            event = self.events.get_nowait()
            if isinstance(event, WorkerClientError):
                self.events.put_nowait(event)  # nothing follows an error: order is kept
                break
            self._taken(event)
            events.append(event)
        return events

    def _taken(self, event: RequestEvent) -> None:
        if isinstance(event, TokenChunk):
            self.buffered -= len(event.token_ids)

    async def _get(self) -> RequestEvent | WorkerClientError:
        loop = asyncio.get_running_loop()
        # loop.time() is time.monotonic() on every platform we run on; stay explicit.
        when = loop.time() + (self.deadline - time.monotonic())
        self.reading = True
        try:
            async with asyncio.timeout_at(when):
                return await self.events.get()
        except TimeoutError:
            raise WorkerTimeout(
                "the request took longer than the server's request timeout"
            ) from None
        finally:
            self.reading = False


class WorkerClient:
    """Owns the DEALER socket: says Hello, pings, routes replies to requests, watches liveness."""

    def __init__(
        self,
        config: GatewayConfig,
        directory: ModelDirectory,
        metrics: GatewayMetrics | None = None,
        *,
        endpoint: str | None = None,
        identity: str | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.config = config
        self.endpoint = endpoint or config.worker_endpoints[0]  # one worker's address
        self.identity = identity or gateway_identity()
        self.directory = directory  # which model a worker serves; the vocabularies
        self.metrics = metrics
        self.info: ModelInfo | None = None  # the worker's answer to our latest Hello
        self.model: str | None = None  # the name its model is served under, once placed
        self._vocab_wanted: str | None = None  # the fingerprint asked for with VocabQuery
        self.heartbeat: Heartbeat | None = None  # the worker's latest load report
        self._sent_since_heartbeat: list[str] = []  # request ids that report cannot count
        self.incompatible: str | None = None  # why we refuse to serve with this worker
        self._lost_because = f"not connected to the worker at {self.endpoint}"
        self._handshake_failure: str | None = None  # the latest, until a handshake succeeds
        self._requests: dict[str, RequestHandle] = {}
        self._slot_queries: dict[str, asyncio.Future[SlotsReport]] = {}  # by query id
        self._last_seen = -float("inf")
        self._last_ping = -float("inf")
        self._owns_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._answered = asyncio.Event()  # set by the first ModelInfo

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Connect and start the receive, heartbeat and connection-watch loops."""
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity.encode())
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
        sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing for a worker that is not connected: a message meant for a dead
        # worker must never reach the next one.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.IPV6, 1)  # a resolved worker address may be IPv6
        _set_curve(sock, self.config)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
        )
        sock.connect(self.endpoint)
        self._socket = sock
        self._tasks = [
            asyncio.create_task(self._receive_loop(sock), name="worker-receive"),
            asyncio.create_task(self._heartbeat_loop(), name="worker-heartbeat"),
            asyncio.create_task(self._watch_connection(monitor), name="worker-monitor"),
        ]
        log.info("connecting to worker", worker=self.endpoint, gateway_id=self.identity)

    async def wait_for_worker(self, timeout: float) -> bool:
        """Wait up to timeout for the worker's first ModelInfo; whether it came."""
        try:
            async with asyncio.timeout(timeout):
                await self._answered.wait()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop the loops, end open requests, close the socket."""
        if self._socket is not None:
            # Before the watch task closes its end of the monitor pipe: libzmq's last monitor
            # event is a blocking send, which waits for ever once that end is gone.
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
        await stop_tasks(self._tasks)
        self._tasks = []
        self._fail_all(WorkerLost("the gateway is shutting down"))
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._owns_context:
            self._context.destroy(linger=0)

    # --- state -----------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        """Why requests cannot be served now; None when the worker is ready for them."""
        if self.incompatible:
            return self.incompatible
        if self.info is None:
            return self._lost_because
        if time.monotonic() - self._last_seen > self.config.worker_timeout:
            return "the worker stopped responding"
        if self._vocab_wanted is not None:
            return "the gateway is loading the worker's vocabulary and chat template"
        ready = self.heartbeat.ready if self.heartbeat is not None else self.info.ready
        return None if ready else "the worker is not ready yet"

    @property
    def answered(self) -> bool:
        """Whether a worker ever answered this client's Hello."""
        return self._answered.is_set()

    @property
    def open_requests(self) -> int:
        """Requests sent to this worker that have not finished."""
        return len(self._requests)

    @property
    def pending_requests(self) -> int:
        """Open requests sent after the latest heartbeat: its load figures lack them."""
        return sum(request_id in self._requests for request_id in self._sent_since_heartbeat)

    # --- requests --------------------------------------------------------------

    async def submit(
        self, message: Generate | Embed, deadline: float | None = None
    ) -> RequestHandle:
        """Send a Generate or an Embed and wait for the worker's first answer to it.

        A Generate's is Accepted (within the request timeout): its tokens follow on the handle,
        whose reads raise WorkerTimeout once `deadline` (time.monotonic()) passes. An Embed's is
        its Embeddings, in the handle's `accepted`, by `deadline` (the request timeout when
        None), else WorkerTimeout. Either way: WorkerUnavailable or WorkerRejected (the request
        never ran), or WorkerLost.
        """
        reason = self.unavailable_reason()
        if reason:
            raise WorkerUnavailable(reason)
        request_id = message.request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id} is already in use")
        generation = isinstance(message, Generate)  # else the reply is the whole answer
        if deadline is None:
            deadline = time.monotonic() + self.config.request_timeout
        accepted = asyncio.get_running_loop().create_future()
        handle = RequestHandle(request_id, deadline, accepted)
        self._requests[request_id] = handle
        if not self._send(message):
            self._requests.pop(request_id, None)
            raise WorkerUnavailable(f"not connected to the worker at {self.endpoint}")
        if generation:
            self._sent_since_heartbeat.append(request_id)
        # A worker that dies fails this future at once (see _worker_lost); one that is alive
        # but mid-way through a long tick confirms a Generate after it, so wait for that.
        wait = self.config.request_timeout if generation else deadline - time.monotonic()
        try:
            async with asyncio.timeout(wait):
                reply = await handle.accepted
        except TimeoutError:
            self.cancel(handle)
            self._requests.pop(request_id, None)
            if generation:
                raise WorkerUnavailable("the worker did not confirm the request in time") from None
            raise WorkerTimeout("the embeddings took longer than the request timeout") from None
        except asyncio.CancelledError:
            self.cancel(handle)
            if not generation:  # a Generate's Finish still comes, and closes it
                self._requests.pop(request_id, None)
            raise
        if isinstance(reply, Rejected):
            raise WorkerRejected(reply.code, reply.message)
        return handle

    def cancel(self, handle: RequestHandle, reason: str = FinishReason.CANCELLED) -> None:
        """Ask the worker to stop a request; its Finish still arrives and is routed as usual.
        reason: the finish the worker records, "stop" when the gateway ended the reply."""
        if handle.cancelled or handle.request_id not in self._requests:
            return
        handle.cancelled = True
        self._send(Cancel(handle.request_id, reason))

    def is_open(self, handle: RequestHandle) -> bool:
        """Whether the worker may still send for this request (no Finish yet)."""
        return handle.request_id in self._requests

    def in_use(self, request_id: str) -> bool:
        """Whether a request with this id is open (ids are unique per gateway)."""
        return request_id in self._requests

    def forget(self, handle: RequestHandle) -> None:
        """Stop routing a request's messages (after cancelling it)."""
        self._requests.pop(handle.request_id, None)

    async def slots(self, timeout: float) -> SlotsReport:
        """The worker's slots and queue as its loop last published them (GET /slots).

        Raises WorkerUnavailable when not connected, WorkerTimeout past `timeout`, WorkerLost.
        """
        if self.info is None:
            raise WorkerUnavailable(self._lost_because)
        query_id = secrets.token_hex(8)
        reply: asyncio.Future[SlotsReport] = asyncio.get_running_loop().create_future()
        self._slot_queries[query_id] = reply
        try:
            if not self._send(SlotsQuery(query_id)):
                raise WorkerUnavailable(f"not connected to the worker at {self.endpoint}")
            async with asyncio.timeout(timeout):
                return await reply
        except TimeoutError:
            raise WorkerTimeout(f"the worker did not report its slots in {timeout:g}s") from None
        finally:
            self._slot_queries.pop(query_id, None)

    # --- loops -----------------------------------------------------------------

    async def _receive_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            self._receive(await sock.recv_multipart())

    def _receive(self, frames: list[bytes]) -> None:
        self._last_seen = time.monotonic()
        try:
            message = decode(frames)
        except DecodeError as exc:
            log.warning("dropped a bad frame from the worker", error=str(exc))
            return
        try:
            self._dispatch(message)
        except Exception:
            log.exception("failed to handle a worker message", type=type(message).__name__)

    def _receive_waiting(self) -> None:
        """Handle every message already in the socket, now, ahead of the receive loop."""
        while self._socket is not None:
            try:
                frames = _future(self._socket.recv_multipart(flags=zmq.NOBLOCK)).result()
            except zmq.Again:
                return
            self._receive(frames)

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval
        period = min(interval, self.config.worker_timeout / 4)
        last_round = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last_round > self.config.worker_timeout:
                # This gateway was stalled (SIGSTOP, a swap storm), not the worker: what the
                # worker said meanwhile waits in our socket. Judge the worker from now on.
                log.warning("this gateway was stalled", seconds=round(now - last_round, 2))
                self._last_seen = max(self._last_seen, now)
            last_round = now
            if self.info is not None and now - self._last_seen > self.config.worker_timeout:
                self._worker_lost(f"the worker sent nothing for {self.config.worker_timeout:g}s")
            if now - self._last_ping >= interval:
                self._last_ping = now
                # Until a worker answers our Hello, keep saying it: a restarted worker
                # does not know this gateway.
                self._send(Hello(self.identity) if self.info is None else Ping(time.time()))
            await asyncio.sleep(period)

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    log.info("connected to worker", worker=self.endpoint)
                    if self._handshake_failure is not None:
                        self._handshake_failure = None
                        self._lost_because = f"waiting for the worker at {self.endpoint}"
                    self._send(Hello(self.identity))
                elif event["event"] & HANDSHAKE_FAILED:
                    self._on_handshake_failed(event["event"], int(event["value"]))
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    # A dropped TCP connection usually means the worker process is gone.
                    # What it said last (its Finishes, an engine_dead) may still wait in the
                    # socket: hand that out first, so each request ends with its own error.
                    await asyncio.sleep(DISCONNECT_GRACE_SECONDS)
                    self._receive_waiting()
                    self._worker_lost("the connection to the worker closed")
        finally:
            monitor.close(linger=0)

    def _on_handshake_failed(self, event: int, value: int) -> None:
        """Say why the worker cannot be reached: in the 503s, and once in the log (the
        socket tries again every second)."""
        curve = self.config.curve_server_key_file is not None
        why = handshake_failure(event, value, curve) or "the handshake failed"
        if self.info is None:
            self._lost_because = f"cannot connect to the worker at {self.endpoint}: {why}"
        if why != self._handshake_failure:
            self._handshake_failure = why
            log.error("handshake with the worker failed", worker=self.endpoint, reason=why)

    # --- worker messages ----------------------------------------------------------

    def _dispatch(self, message: Message) -> None:
        match message:
            case Outputs():
                self._on_outputs(message)
            case Heartbeat():
                self.heartbeat = message
                self._sent_since_heartbeat.clear()
                if message.ping_sent_at > 0 and self.metrics is not None:
                    self.metrics.worker_rtt.observe(max(0.0, time.time() - message.ping_sent_at))
            case Accepted():
                handle = self._requests.get(message.request_id)
                if handle is not None and not handle.accepted.done():
                    handle.accepted.set_result(message)
            case Rejected() | Embeddings():
                handle = self._requests.pop(message.request_id, None)
                if handle is not None and not handle.accepted.done():
                    handle.accepted.set_result(message)
            case SlotsReport():
                query = self._slot_queries.get(message.query_id)
                if query is not None and not query.done():
                    query.set_result(message)
            case ModelInfo():
                self._on_model_info(message)
            case VocabFile():
                self._on_vocab_file(message)
            case WorkerError():
                self._on_worker_error(message)
            case _:
                log.warning("unexpected message from the worker", type=type(message).__name__)

    def _on_outputs(self, outputs: Outputs) -> None:
        limit = self.config.stream_buffer_tokens
        for chunk in outputs.tokens:
            handle = self._requests.get(chunk.request_id)
            if handle is not None:
                handle.events.put_nowait(chunk)
                handle.buffered += len(chunk.token_ids)
                if handle.buffered > limit and not handle.reading:
                    self._reader_too_slow(handle, limit)
        for finish in outputs.finishes:
            handle = self._requests.pop(finish.request_id, None)
            if handle is not None:
                handle.events.put_nowait(finish)

    def _on_model_info(self, info: ModelInfo) -> None:
        problem, placement = None, None
        if info.protocol_version != PROTOCOL_VERSION:
            problem = (
                f"the worker speaks protocol {info.protocol_version}, this gateway "
                f"{PROTOCOL_VERSION}; run matching versions"
            )
        else:
            placement = self.directory.place(info)
            problem = placement.problem
        self.incompatible = problem
        self.info = info
        self.model = placement.name if placement else None
        self.heartbeat = None
        self._sent_since_heartbeat.clear()
        self._vocab_wanted = None
        if problem is None and self.model is not None:
            self._prepare_model(self.model, info.vocab_fingerprint)
        self._answered.set()
        if problem:
            log.error("refusing to serve with this worker", worker=self.endpoint, reason=problem)
        else:
            log.info(
                "worker ready",
                worker=self.endpoint,
                model=self.model,
                slots=info.slots,
                slot_context=info.slot_context,
                ready=info.ready,
            )

    def _prepare_model(self, model: str, fingerprint: str) -> None:
        """Out of rotation until the gateway has the model's vocabulary and chat template:
        from its own files, or from the worker (VocabQuery, answered by a VocabFile)."""
        if self.directory.is_ready(model, fingerprint):
            return
        self._vocab_wanted = fingerprint
        if self.directory.has_vocabulary(fingerprint):
            self._start_prepare(model, fingerprint, None)
        else:
            log.info("fetching the worker's vocabulary", worker=self.endpoint, model=model)
            self._send(VocabQuery(fingerprint))

    def _on_vocab_file(self, answer: VocabFile) -> None:
        if answer.vocab_fingerprint != self._vocab_wanted or self.model is None:
            return  # an answer to an earlier Hello's query
        if answer.error:
            self._refuse_vocabulary(answer.vocab_fingerprint, answer.error)
            return
        self._start_prepare(self.model, answer.vocab_fingerprint, answer.gguf_zlib)

    def _start_prepare(self, model: str, fingerprint: str, gguf_zlib: bytes | None) -> None:
        task = asyncio.create_task(self._prepare(model, fingerprint, gguf_zlib), name="prepare")
        self._tasks = [task, *(other for other in self._tasks if not other.done())]

    async def _prepare(self, model: str, fingerprint: str, gguf_zlib: bytes | None) -> None:
        problem = await self.directory.prepare(model, fingerprint, gguf_zlib)
        if self._vocab_wanted != fingerprint:
            return  # the worker went away, or came back as another, meanwhile
        if problem is not None:
            self._refuse_vocabulary(fingerprint, problem)
            return
        self._vocab_wanted = None
        log.info("model ready to serve", worker=self.endpoint, model=model)

    def _refuse_vocabulary(self, fingerprint: str, why: str) -> None:
        self._vocab_wanted = None
        self.incompatible = f"cannot use the worker's vocabulary: {why}"
        log.error("refusing to serve with this worker", worker=self.endpoint, reason=why)

    def _on_worker_error(self, error: WorkerError) -> None:
        log.error("worker error", worker=self.endpoint, code=error.code, message=error.message)
        if error.code == ErrorCode.PROTOCOL_MISMATCH:
            self.incompatible = f"the worker refused this gateway: {error.message}"
        elif error.code == ErrorCode.GATEWAY_LOST:
            # The worker had given up on us (and cancelled our requests): start over.
            self._worker_lost(
                "this gateway was unresponsive for longer than the worker's gateway timeout "
                "and the worker cancelled its requests",
                gateway_side=True,
            )
        elif error.code == ErrorCode.ENGINE_DEAD:
            # The worker exits to be restarted; until a worker answers Hello again: 503.
            self._worker_lost(f"its engine failed ({error.message}) and it is restarting")

    # --- failures ----------------------------------------------------------------

    def _reader_too_slow(self, handle: RequestHandle, limit: int) -> None:
        """Its client stopped reading (its connection is full, so the gateway stopped taking
        tokens): cancel it in the worker rather than hold a slot and buffer its whole output.
        The tokens already here are still handed out, then the error."""
        log.warning(
            "client reads too slowly; request cancelled",
            request_id=handle.request_id,
            buffered_tokens=handle.buffered,
            worker=self.endpoint,
        )
        self.cancel(handle)
        self.forget(handle)  # its Finish would come after the error: nothing more is read
        handle.events.put_nowait(
            ReaderTooSlow(
                f"the client did not read its output: {handle.buffered} tokens waited in the "
                f"gateway (more than --stream-buffer-tokens {limit}); the request was cancelled"
            )
        )

    def _worker_lost(self, reason: str, gateway_side: bool = False) -> None:
        """End every open request and say Hello until a worker answers.

        gateway_side: this gateway, not the worker, was at fault; the reason says so as is.
        """
        if self.info is None and not self._requests:
            return
        log.warning(
            "worker lost", worker=self.endpoint, reason=reason, open_requests=len(self._requests)
        )
        for request_id in self._requests:
            # Harmless if the worker is dead; frees the slots if it is merely slow.
            self._send(Cancel(request_id))
        self.info = None
        self.heartbeat = None
        self._last_ping = -float("inf")
        if gateway_side:
            self._lost_because = reason
        else:
            self._lost_because = f"the worker at {self.endpoint} is unavailable: {reason}"
        self._fail_all(WorkerLost(self._lost_because))

    def _fail_all(self, error: WorkerClientError) -> None:
        for query in self._slot_queries.values():
            if not query.done():
                query.set_exception(error)
        requests, self._requests = self._requests, {}
        for handle in requests.values():
            if not handle.accepted.done():
                handle.accepted.set_exception(error)
            handle.events.put_nowait(error)

    def _send(self, message: Message) -> bool:
        """Send without waiting; False when the worker is not connected (nothing is queued)."""
        if self._socket is None:
            return False
        future = _future(
            self._socket.send_multipart(encode(message), flags=zmq.NOBLOCK, copy=False)
        )
        if not future.done():
            future.add_done_callback(_log_send_failure)
            return True
        error = future.exception()
        if error is not None and not isinstance(error, zmq.Again):
            log.warning("send to worker failed", error=str(error))
        return error is None


def _future(awaitable: Awaitable[T]) -> asyncio.Future[T]:
    """A zmq.asyncio socket call's result as what it is: pyzmq types it as an Awaitable, but
    returns an asyncio Future, which with NOBLOCK is often already done."""
    return cast("asyncio.Future[T]", awaitable)


def gateway_identity() -> str:
    """A name for this gateway process that no other gateway has: host, pid, random."""
    return f"gw-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def _set_curve(sock: zmq.Socket, config: GatewayConfig) -> None:
    """CURVE keys on the DEALER when the gateway has them (the worker then must, too)."""
    if config.curve_server_key_file is not None and config.curve_secret_key_file is not None:
        set_curve_client(sock, config.curve_server_key_file, config.curve_secret_key_file)


def _log_send_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("send to worker failed", error=str(future.exception()))


async def stop_tasks(tasks: list[asyncio.Task]) -> None:
    """Cancel background tasks and wait until each has ended."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
