"""WorkerClient: the gateway's connection to one worker, and whether that worker can serve.

It says Hello until a worker answers (with a ModelInfo; preparation.py places its model),
pings, and tracks the worker's liveness from every message it receives: when the worker goes
silent for worker_timeout, its connection drops or its handshake fails, every open request
ends with WorkerLost and the client says Hello again. Requests go out through `submit`; the
worker's replies to them are routed by OpenRequests (open_requests.py) to each request's
RequestHandle (handle.py). The socket itself is set up in dealer.py. A Generate that the
worker never confirmed is never sent again.

The client speaks the protocol only: it raises the transport errors of errors.py, and knows
nothing of HTTP. With several workers there is one client per worker; pool.py owns them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ...protocol.codec import DecodeError, decode
from ...protocol.messages import (
    Cancel,
    Embed,
    ErrorCode,
    FinishReason,
    Generate,
    Heartbeat,
    Hello,
    ImageTokens,
    Message,
    ModelInfo,
    Ping,
    SlotsReport,
    VocabFile,
    WorkerError,
)
from ..config import GatewayConfig
from ..metrics import GatewayMetrics
from .dealer import Dealer, gateway_identity, open_dealer
from .directory import ModelDirectory
from .errors import (
    WorkerLost,
    WorkerUnavailable,
)
from .handle import RequestHandle
from .handshake import HANDSHAKE_FAILED, handshake_failure
from .open_requests import OpenRequests
from .preparation import ModelPreparation

log = structlog.get_logger(__name__)

DISCONNECT_GRACE_SECONDS = 0.1  # for the last messages to reach the socket


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
        self.heartbeat: Heartbeat | None = None  # the worker's latest load report
        self.incompatible: str | None = None  # why we refuse to serve with this worker
        self._lost_because = f"not connected to the worker at {self.endpoint}"
        self._handshake_failure: str | None = None  # the latest, until a handshake succeeds
        self._open = OpenRequests(config, self.endpoint, self._send)
        self._preparation = ModelPreparation(directory, self.endpoint, self._send)
        self._last_seen = -float("inf")
        self._last_ping = -float("inf")
        self._owns_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._dealer: Dealer | None = None
        self._tasks: list[asyncio.Task] = []
        self._answered = asyncio.Event()  # set by the first ModelInfo

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Connect, read the worker's messages as they come, and start the heartbeat and
        connection-watch loops."""
        sock, monitor = open_dealer(self._context, self.config, self.endpoint, self.identity)
        self._dealer = Dealer(sock, self._receive)
        self._tasks = [
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
        if self._dealer is not None:
            # Before the watch task closes its end of the monitor pipe: libzmq's last monitor
            # event is a blocking send, which waits for ever once that end is gone.
            with contextlib.suppress(zmq.ZMQError):
                self._dealer.socket.disable_monitor()
        await stop_tasks([*self._tasks, *self._preparation.tasks])
        self._tasks = []
        self._open.fail_all(WorkerLost("the gateway is shutting down"))
        if self._dealer is not None:
            self._dealer.close()
            self._dealer = None
        if self._owns_context:
            self._context.destroy(linger=0)

    # --- state -----------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        """Why requests cannot be served now; None when the worker is ready for them."""
        incompatible = self.incompatible or self._preparation.refused
        if incompatible:
            return incompatible
        if self.info is None:
            return self._lost_because
        if time.monotonic() - self._last_seen > self.config.worker_timeout:
            return "the worker stopped responding"
        if self._preparation.wanted is not None:
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
        return len(self._open)

    @property
    def pending_requests(self) -> int:
        """Open requests sent after the latest heartbeat: its load figures lack them."""
        return self._open.pending

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
        return await self._open.submit(message, deadline)

    def cancel(self, handle: RequestHandle, reason: str = FinishReason.CANCELLED) -> None:
        """Ask the worker to stop a request; its Finish still arrives and is routed as usual.
        reason: the finish the worker records, "stop" when the gateway ended the reply."""
        self._open.cancel(handle, reason)

    def is_open(self, handle: RequestHandle) -> bool:
        """Whether the worker may still send for this request (no Finish yet)."""
        return handle.request_id in self._open

    def in_use(self, request_id: str) -> bool:
        """Whether a request with this id is open (ids are unique per gateway)."""
        return request_id in self._open

    def forget(self, handle: RequestHandle) -> None:
        """Stop routing a request's messages (after cancelling it)."""
        self._open.pop(handle.request_id)

    async def slots(self, timeout: float) -> SlotsReport:
        """The worker's slots and queue as its loop last published them (GET /slots).

        Raises WorkerUnavailable when not connected, WorkerTimeout past `timeout`, WorkerLost.
        """
        if self.info is None:
            raise WorkerUnavailable(self._lost_because)
        return await self._open.query_slots(timeout)

    async def image_tokens(self, images: list[bytes], timeout: float) -> ImageTokens:
        """How many prompt positions each image takes on the worker's projector.

        Raises WorkerUnavailable when not connected, WorkerTimeout past `timeout`, WorkerLost.
        """
        if self.info is None:
            raise WorkerUnavailable(self._lost_because)
        return await self._open.query_image_tokens(images, timeout)

    # --- loops -----------------------------------------------------------------

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
                    if self._dealer is not None:
                        self._dealer.drain()
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
            case Heartbeat():
                self.heartbeat = message
                self._open.heartbeat_came()
                if message.ping_sent_at > 0 and self.metrics is not None:
                    self.metrics.worker_rtt.observe(max(0.0, time.time() - message.ping_sent_at))
            case ModelInfo():
                self._on_model_info(message)
            case VocabFile():
                self._preparation.on_vocab_file(message, self.model)
            case WorkerError():
                self._on_worker_error(message)
            case _ if self._open.route(message):
                pass  # a reply to one request or query, now on its way there
            case _:
                log.warning("unexpected message from the worker", type=type(message).__name__)

    def _on_model_info(self, info: ModelInfo) -> None:
        # The answer to a repeated Hello (one on connecting, one from the ping loop) repeats.
        repeated = info == self.info
        self.model, problem = self._preparation.place(info)
        self.incompatible = problem
        self.info = info
        self.heartbeat = None
        self._open.heartbeat_came()
        self._answered.set()
        if problem:
            log.error("refusing to serve with this worker", worker=self.endpoint, reason=problem)
        elif not repeated:
            log.info(
                "worker ready",
                worker=self.endpoint,
                model=self.model,
                slots=info.slots,
                slot_context=info.slot_context,
                ready=info.ready,
            )

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

    def _worker_lost(self, reason: str, gateway_side: bool = False) -> None:
        """End every open request and say Hello until a worker answers.

        gateway_side: this gateway, not the worker, was at fault; the reason says so as is.
        """
        if self.info is None and not self._open:
            return
        log.warning(
            "worker lost", worker=self.endpoint, reason=reason, open_requests=len(self._open)
        )
        for request_id in self._open.handles:
            # Harmless if the worker is dead; frees the slots if it is merely slow.
            self._send(Cancel(request_id))
        self.info = None
        self.heartbeat = None
        self._last_ping = -float("inf")
        if gateway_side:
            self._lost_because = reason
        else:
            self._lost_because = f"the worker at {self.endpoint} is unavailable: {reason}"
        self._open.fail_all(WorkerLost(self._lost_because))

    def _send(self, message: Message) -> bool:
        """Send without waiting; False when the worker is not connected (nothing is queued)."""
        return self._dealer is not None and self._dealer.send(message)


async def stop_tasks(tasks: list[asyncio.Task]) -> None:
    """Cancel background tasks and wait until each has ended."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
