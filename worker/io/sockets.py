"""The worker's ZeroMQ side: one IO thread owns the ROUTER socket that gateways connect to.

Like vLLM's engine core, the tick loop never waits on the network, and neither side holds the
other: they share channels made first (channels.py). Inbound frames go to the GatewayDesk
(gateways.py), which decodes them, answers what the IO thread answers itself (Hello, Ping,
SlotsQuery, VocabQuery) and puts work on the loop's Inbox. What the loop says goes into
this module's Outbox, and its flush sends it on the loop's own thread when the socket is free
(a lock: the socket is never used by two threads at once); only when this thread holds the
socket does a wake-up byte over an inproc PAIR leave the sending to it. Handing every tick's
tokens to this thread instead cost it 0.32 ms of CPU a token on the 2-core VM (the wake-up,
the poll, the GIL passed back and forth), on the cores the forward passes run on, against
tens of microseconds to encode and send them where they are made. Heartbeats and
SlotsReports read the SchedulerStats on the loop's StatsBoard, a frozen snapshot of its
latest tick. Sends never block: a gateway that is gone (EHOSTUNREACH) loses its requests; a
slow one (EAGAIN) loses that message, counted. This thread also heartbeats every gateway, so
liveness and /slots never wait for a tick either.

So that this thread can wait while another sends, it waits on the socket's file descriptor
(ZMQ_FD), not on the socket: libzmq signals edges there, and any send or read may take the
edge that says messages came, so after each turn with the socket ZMQ_EVENTS says whether any
wait, and a flush that finds some wakes this thread.

Whatever reaches the socket is bounded: frames by ZMQ_MAXMSGSIZE, frames buffered per
connection by ZMQ_RCVHWM (then TCP pushes back), the cost of decoding one by the codec's
limits, one turn of receiving by time, and what gateways may have open by GatewayTable.
CURVE (worker/io/curve.py) decides who may connect at all.
"""

from __future__ import annotations

import contextlib
import errno
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import cast

import structlog
import zmq

from ...protocol import (
    MAX_FRAME_BYTES,
    Embeddings,
    ErrorCode,
    Heartbeat,
    ImageTokensQuery,
    Message,
    ModelInfo,
    Outputs,
    Rejected,
    SlotsReport,
    VocabFile,
    encode,
)
from ..config import WorkerConfig
from .channels import Inbox, StatsBoard
from .curve import ServerKeys, make_curve_server
from .gateways import GatewayDesk, IOCounters, Replies, name_of
from .handshake import HandshakeWatch

log = structlog.get_logger(__name__)

# Outbound messages queued per gateway before sends fail with EAGAIN: one Outputs per tick,
# so seconds of tokens at full speed; a gateway that falls further behind is stuck.
SEND_HWM = 10_000
# Inbound messages libzmq buffers per connection before it stops reading that connection
# (the sender's queue and TCP then hold the rest): at most this many frames of
# MAX_FRAME_BYTES each, however fast a peer sends. This thread drains far faster.
RECV_HWM = 16
RECV_BATCH = 256  # most inbound messages handled before the outbox gets a turn
RECV_TURN_SECONDS = 0.05  # nor longer than this: heartbeats keep their time under a flood
CLOSE_LINGER_MS = 500  # at shutdown, how long queued messages may take to leave


BROADCAST = b""  # the outbox's address for "every gateway" (no ROUTER identity is empty)


class Outbox:
    """The Sink the loop sends through in a worker process (channels.Sink): messages wait
    here until `flush` sends them (never blocking: on the calling thread when the socket is
    free, else by the IO thread). send is the loop thread's; broadcast and post any thread's."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self.messages: deque[tuple[bytes, Message]] = deque()
        self._flush = flush

    def send(self, gateway: bytes, message: Message) -> None:
        self.messages.append((gateway, message))

    def broadcast(self, message: Message) -> None:
        """Send a message to every known gateway (from any thread; it goes with the outbox)."""
        self.messages.append((BROADCAST, message))
        self.flush()

    def post(self, gateway: bytes, message: Message) -> None:
        """Send a message to one gateway from any thread (the media encoder's answers)."""
        self.messages.append((gateway, message))
        self.flush()

    def flush(self) -> None:
        """Send what the outbox holds, now or as soon as the IO thread's turn ends."""
        self._flush()


class WorkerIO:
    """The ROUTER socket, its thread, and the Outbox the loop sends through."""

    def __init__(
        self,
        config: WorkerConfig,
        model_info: ModelInfo,
        inbox: Inbox,
        board: StatsBoard,
        on_gateways: Callable[[int], None] | None = None,
        keys: ServerKeys | None = None,
        on_reject: Callable[[str], None] | None = None,
        vocab_file: bytes = b"",
        count_images: Callable[[bytes, ImageTokensQuery], None] | None = None,
    ) -> None:
        self.config = config
        self.vocab_file = vocab_file  # vocab_file.compressed_metadata, for VocabQuery
        self.board = board  # what the loop last published, for heartbeats and /slots
        self.model_info = model_info
        self.ready = True
        self._busy_at = time.monotonic()  # when work was last queued or running here
        replies = Replies(
            self._send_now,
            self._hello,
            self._heartbeat_message,
            self._slots_report,
            self._vocab_answer,
        )
        self._desk = GatewayDesk(
            inbox,
            replies,
            max_items=max(model_info.slot_context, model_info.vocab_size),
            max_open=config.slots + config.max_queue,
            on_gateways=on_gateways,
            on_reject=on_reject,
            count_images=count_images,
        )
        self.counters: IOCounters = self._desk.counters
        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a larger one drops its peer
        self._router.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._router.setsockopt(zmq.RCVHWM, RECV_HWM)
        self._router.setsockopt(zmq.LINGER, 0)
        self._auth = make_curve_server(self._context, self._router, keys) if keys else None
        self._handshakes = HandshakeWatch(self._router, curve=keys is not None)
        try:
            self._router.bind(config.bind)
        except zmq.ZMQError:
            self._close_sockets(linger=0)
            raise
        wake_address = f"inproc://loomserve-wake-{id(self)}"
        self._wake_in = self._context.socket(zmq.PAIR)
        self._wake_in.bind(wake_address)
        self._wake_out = self._context.socket(zmq.PAIR)
        self._wake_out.setsockopt(zmq.SNDHWM, 1)
        self._wake_out.setsockopt(zmq.LINGER, 0)
        self._wake_out.connect(wake_address)
        self._lock = threading.Lock()  # the ROUTER and the desk: one thread at a time
        self.outbox = Outbox(self._flush)  # the loop's Sink
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="worker-io", daemon=True)

    @property
    def endpoint(self) -> str:
        """The address actually bound (a tcp://...:0 bind gets its port here)."""
        return self._router.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        """Serve: receive into the inbox, send what the outbox holds."""
        self._thread.start()

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        self._closing = True
        self._wake()  # the IO thread sends what is left, and returns
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._wake_out.close(linger=0)
        self._wake_in.close(linger=0)
        # The last Finish messages get a moment to leave; a dead gateway cannot hold us.
        self._close_sockets(linger=CLOSE_LINGER_MS)

    def _flush(self) -> None:
        """Send the outbox on this thread if the socket is free; else the IO thread, which
        holds it, sends it when its turn ends (it always does). A send may take the edge
        that tells the IO thread a message came: then it is woken."""
        if not self._lock.acquire(blocking=False):
            self._wake()
            return
        try:
            self._send_outbox()
            readable = self._readable()
        finally:
            self._lock.release()
        if readable:
            self._wake()

    def _readable(self) -> bool:
        """Whether messages wait in the ROUTER (with the lock held)."""
        return bool(cast(int, self._router.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _wake(self) -> None:
        """One byte to the IO thread's poll, never blocking: on EAGAIN a wake-up is already
        pending, and it will find the new messages too."""
        with contextlib.suppress(zmq.Again):
            self._wake_out.send(b"", zmq.NOBLOCK)

    def _close_sockets(self, linger: int) -> None:
        self._handshakes.stop()
        self._router.close(linger=linger)
        if self._auth is not None:
            self._auth.stop()
        self._context.term()

    # --- the IO thread -----------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router.FD, zmq.POLLIN)  # the descriptor: see the docstring
        poller.register(self._wake_in, zmq.POLLIN)
        interval = self.config.heartbeat_interval
        # Silence is checked ten times per gateway_timeout, so a stalled gateway's slots are
        # freed at most a tenth of the timeout after it (3.3 s with the defaults).
        check_every = min(interval, self.config.gateway_timeout / 10)
        started = time.monotonic()
        next_beat, next_check = started + interval, started + check_every
        more = True  # messages may wait that no edge will announce (the first turn, a cut one)
        while True:
            wait_s = 0.0 if more else max(0.0, min(next_beat, next_check) - time.monotonic())
            # Whole milliseconds (pyzmq truncates floats), rounded up: truncated, the poll
            # came back a fraction of a millisecond early, and the thread then turned on
            # zero-timeout polls until the deadline, a dozen turns each time.
            events = dict(poller.poll(timeout=math.ceil(wait_s * 1000)))
            if self._wake_in in events:
                self._drain_wakes()
            now = time.monotonic()
            with self._lock:
                self._receive()
                self._send_outbox()
                if self._closing:
                    return
                if now >= next_check:
                    self._desk.expire_silent(now, self.config.gateway_timeout)
                    next_check = now + check_every
                if now >= next_beat:
                    self._heartbeat()
                    next_beat = now + interval
                more = self._readable()

    def _drain_wakes(self) -> None:
        while True:
            try:
                self._wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _receive(self) -> None:
        deadline = time.monotonic() + RECV_TURN_SECONDS
        for _ in range(RECV_BATCH):
            if time.monotonic() > deadline:
                return  # the poll finds the rest at once, after heartbeats had their turn
            try:
                # Zero-copy: a large frame is decoded (or refused) where libzmq received it.
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            gateway, body = frames[0].bytes, [frame.buffer for frame in frames[1:]]
            now = time.monotonic()
            if self._desk.receive(gateway, body, now):
                self._busy_at = now

    def _send_outbox(self) -> None:
        outbox, gateways = self.outbox.messages, self._desk.table
        while outbox:
            gateway, message = outbox.popleft()
            if gateway == BROADCAST:
                for known in list(gateways.known):
                    self._send_now(known, message)
                continue
            if isinstance(message, Rejected):
                duplicate = message.code == ErrorCode.DUPLICATE_REQUEST
                gateways.close(gateway, message.request_id, duplicate)
            elif isinstance(message, Outputs):
                for finish in message.finishes:
                    gateways.close(gateway, finish.request_id)
            elif isinstance(message, Embeddings):
                gateways.close(gateway, message.request_id)
            # A gateway lost to silence may still be connected: its Finish(cancelled)
            # messages still try to reach it. A disconnected one fails fast (EHOSTUNREACH).
            if gateway in gateways or gateway in gateways.lost:
                self._send_now(gateway, message)

    def _send_now(self, gateway: bytes, message: Message) -> None:
        try:
            self._router.send_multipart([gateway, *encode(message)], zmq.NOBLOCK)
        except zmq.Again:
            self.counters.dropped_slow += 1
            if self.counters.dropped_slow % 1000 == 1:
                log.warning("gateway too slow; dropped a message", gateway=name_of(gateway))
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.counters.dropped_gone += 1
            self._desk.lose(gateway, "it disconnected")

    def _heartbeat(self) -> None:
        beat = self._heartbeat_message(0.0)
        for gateway in list(self._desk.table.known):
            self._send_now(gateway, beat)

    def _heartbeat_message(self, ping_sent_at: float) -> Heartbeat:
        stats = self.board.latest
        now = time.monotonic()
        if stats.load.running or stats.load.queue_depth:
            self._busy_at = now
        return Heartbeat(
            sent_at=time.time(),
            ping_sent_at=ping_sent_at,
            ready=self.ready,
            load=stats.load,
            prefixes=list(stats.prefixes),
            kv_cells_used=stats.kv_cells_used,
            kv_cells_total=self.model_info.slots * self.model_info.slot_context,
            idle_seconds=now - self._busy_at,
        )

    def _vocab_answer(self, fingerprint: str) -> VocabFile:
        own = self.model_info.vocab_fingerprint
        if fingerprint != own:
            return VocabFile(fingerprint, b"", f"this worker's vocabulary is {own}")
        if not self.vocab_file:
            return VocabFile(own, b"", "this worker cannot send its vocabulary")
        if len(self.vocab_file) > MAX_FRAME_BYTES - 1024:
            return VocabFile(
                own,
                b"",
                f"the vocabulary ({len(self.vocab_file)} bytes compressed) is larger than a "
                "message may be; give the gateway the model file (--model)",
            )
        return VocabFile(own, self.vocab_file)

    def _slots_report(self, query_id: str) -> SlotsReport:
        stats = self.board.latest
        return SlotsReport(
            query_id=query_id,
            queue_depth=stats.load.queue_depth,
            slots=stats.slot_states(time.monotonic()),
            tenants=stats.tenant_queues(),
        )

    def _hello(self) -> ModelInfo:
        return replace(self.model_info, ready=self.ready)
