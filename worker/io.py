"""The worker's ZeroMQ side: one IO thread owns the ROUTER socket that gateways connect to.

Like vLLM's engine core, the tick loop never waits on the network. Inbound frames are
decoded here and handed to the loop through its queue; what the loop says is appended to
an outbox and a wake-up byte goes over an inproc PAIR, after which this thread encodes and
sends (while the loop is inside llama_decode, which releases the GIL). Sends never block:
a gateway that is gone (EHOSTUNREACH) loses its requests; a slow one (EAGAIN) loses that
message, counted. This thread also answers Hello and Ping and heartbeats every gateway, so
liveness never waits for a tick either.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import zmq

from loomserve.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    DecodeError,
    Embed,
    ErrorCode,
    Generate,
    Heartbeat,
    Hello,
    Message,
    ModelInfo,
    Ping,
    WorkerError,
    decode,
    encode,
)
from loomserve.worker.config import WorkerConfig
from loomserve.worker.loop import Load, TickLoop

log = structlog.get_logger(__name__)

# Outbound messages queued per gateway before sends fail with EAGAIN: deep enough for
# seconds of tokens at full speed; a gateway that falls further behind is stuck.
SEND_HWM = 100_000
RECV_BATCH = 256  # most inbound messages handled before the outbox gets a turn
CLOSE_LINGER_MS = 500  # at shutdown, how long queued messages may take to leave
LOST_REMEMBERED = 10_000  # lost gateway identities kept to answer with GATEWAY_LOST


@dataclass(slots=True)
class IOCounters:
    """What the IO thread counted; the metrics read these."""

    malformed: int = 0  # frames that did not decode; dropped
    dropped_slow: int = 0  # sends refused with EAGAIN: the gateway reads too slowly
    dropped_gone: int = 0  # sends refused with EHOSTUNREACH: the gateway disconnected
    gateways_lost: int = 0  # gateways given up on (silence or disconnection)


class WorkerIO:
    """The ROUTER socket, its thread, and the Sink the loop sends through."""

    def __init__(
        self,
        config: WorkerConfig,
        model_info: ModelInfo,
        on_gateways: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.loop: TickLoop | None = None
        self.model_info = model_info
        self.counters = IOCounters()
        self.ready = True
        self._on_gateways = on_gateways
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._router.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._router.setsockopt(zmq.RCVHWM, SEND_HWM)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(config.bind)
        wake_address = f"inproc://loomserve-wake-{id(self)}"
        self._wake_in = self._context.socket(zmq.PAIR)
        self._wake_in.bind(wake_address)
        self._wake_out = self._context.socket(zmq.PAIR)  # used by the loop thread only
        self._wake_out.setsockopt(zmq.SNDHWM, 1)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(wake_address)
        self._outbox: deque[tuple[bytes, Message]] = deque()
        self._last_seen: dict[bytes, float] = {}  # known gateways -> when they last spoke
        self._lost: dict[bytes, None] = {}  # gateways given up on, until they say Hello again
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="worker-io", daemon=True)

    @property
    def endpoint(self) -> str:
        """The address actually bound (a tcp://...:0 bind gets its port here)."""
        return self._router.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self, loop: TickLoop) -> None:
        """Serve: hand inbound work to this tick loop, whose sink this object is."""
        self.loop = loop
        self._thread.start()

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        self._closing = True
        self.flush()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._wake_out.close(linger=0)
        self._wake_in.close(linger=0)
        # The last Finish messages get a moment to leave; a dead gateway cannot hold us.
        self._router.close(linger=CLOSE_LINGER_MS)
        self._context.term()

    # --- Sink: called by the loop thread ---------------------------------------------

    def send(self, gateway: bytes, message: Message) -> None:
        self._outbox.append((gateway, message))

    def flush(self) -> None:
        """Wake the IO thread to send the outbox; one byte, never blocking."""
        # On EAGAIN a wake-up is already pending; it will find these messages too.
        with contextlib.suppress(zmq.Again):
            self._wake_out.send(b"", zmq.NOBLOCK)

    # --- the IO thread -----------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        interval = self.config.heartbeat_interval
        next_beat = time.monotonic() + interval
        while True:
            wait_ms = max(0.0, next_beat - time.monotonic()) * 1000
            events = dict(poller.poll(timeout=wait_ms))
            if self._wake_in in events:
                self._drain_wakes()
            if self._router in events:
                self._receive()
            self._send_outbox()
            if self._closing:
                return
            now = time.monotonic()
            if now >= next_beat:
                self._heartbeat(now)
                next_beat = now + interval

    def _drain_wakes(self) -> None:
        while True:
            try:
                self._wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _receive(self) -> None:
        for _ in range(RECV_BATCH):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            gateway, body = frames[0], frames[1:]
            try:
                message = decode(body)
            except DecodeError as exc:
                self.counters.malformed += 1
                if self.counters.malformed % 1000 == 1:  # the first, then every 1000th
                    log.warning(
                        "dropped a malformed message",
                        gateway=_name(gateway),
                        error=str(exc),
                        malformed=self.counters.malformed,
                    )
                continue
            self._handle(gateway, message)

    def _handle(self, gateway: bytes, message: Message) -> None:
        now = time.monotonic()
        if isinstance(message, Hello):
            if message.protocol_version != PROTOCOL_VERSION:
                self._send_now(
                    gateway,
                    WorkerError(
                        ErrorCode.PROTOCOL_MISMATCH.value,
                        f"this worker speaks protocol {PROTOCOL_VERSION}, "
                        f"the gateway {message.protocol_version}",
                    ),
                )
                return
            self._lost.pop(gateway, None)
            self._remember(gateway, now)
            log.info("gateway connected", gateway=_name(gateway), gateway_id=message.gateway_id)
            self._send_now(gateway, self.model_info)
            return
        if gateway in self._lost:
            # Its requests were cancelled when it went silent; it must start over.
            self._send_now(
                gateway,
                WorkerError(
                    ErrorCode.GATEWAY_LOST.value,
                    "this gateway was silent too long and its requests were cancelled; "
                    "say Hello again",
                ),
            )
            return
        if isinstance(message, Ping) and gateway not in self._last_seen:
            # A probe that never said Hello (`loomserve worker-health`, a readiness wait):
            # answer it, but it is no gateway, so its silence later means nothing.
            self._send_now(gateway, self._heartbeat_message(message.sent_at))
            return
        self._remember(gateway, now)
        if isinstance(message, Generate):
            self.loop.submit(gateway, message)
        elif isinstance(message, Embed):
            self.loop.embed(gateway, message)
        elif isinstance(message, Cancel):
            self.loop.cancel(gateway, message.request_id)
        elif isinstance(message, Ping):
            self._send_now(gateway, self._heartbeat_message(message.sent_at))
        else:
            self.counters.malformed += 1
            log.warning("dropped a message only workers send", type=type(message).__name__)

    def _remember(self, gateway: bytes, now: float) -> None:
        new = gateway not in self._last_seen
        self._last_seen[gateway] = now
        if new and self._on_gateways:
            self._on_gateways(len(self._last_seen))

    def _send_outbox(self) -> None:
        outbox = self._outbox
        while outbox:
            gateway, message = outbox.popleft()
            # A gateway lost to silence may still be connected: its Finish(cancelled)
            # messages still try to reach it. A disconnected one fails fast (EHOSTUNREACH).
            if gateway in self._last_seen or gateway in self._lost:
                self._send_now(gateway, message)

    def _send_now(self, gateway: bytes, message: Message) -> None:
        try:
            self._router.send_multipart([gateway, *encode(message)], zmq.NOBLOCK)
        except zmq.Again:
            self.counters.dropped_slow += 1
            if self.counters.dropped_slow % 1000 == 1:
                log.warning("gateway too slow; dropped a message", gateway=_name(gateway))
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.counters.dropped_gone += 1
            self._lose(gateway, "it disconnected")

    def _heartbeat(self, now: float) -> None:
        timeout = self.config.gateway_timeout
        for gateway, seen in list(self._last_seen.items()):
            if now - seen > timeout:
                self._lose(gateway, f"it was silent for {timeout:g}s")
        beat = self._heartbeat_message(0.0)
        for gateway in list(self._last_seen):
            self._send_now(gateway, beat)

    def _heartbeat_message(self, ping_sent_at: float) -> Heartbeat:
        load: Load = self.loop.load
        return Heartbeat(
            sent_at=time.time(),
            ping_sent_at=ping_sent_at,
            ready=self.ready,
            queue_depth=load.queue_depth,
            free_slots=load.free_slots,
            running=load.running,
        )

    def _lose(self, gateway: bytes, why: str) -> None:
        if self._last_seen.pop(gateway, None) is None:
            return
        self._lost[gateway] = None
        if len(self._lost) > LOST_REMEMBERED:
            del self._lost[next(iter(self._lost))]
        self.counters.gateways_lost += 1
        log.warning("gateway lost; cancelling its requests", gateway=_name(gateway), why=why)
        self.loop.gateway_gone(gateway)
        if self._on_gateways:
            self._on_gateways(len(self._last_seen))


def _name(identity: bytes) -> str:
    return identity.decode(errors="replace")
