"""The worker's ZeroMQ side: one IO thread owns the ROUTER socket that gateways connect to.

Like vLLM's engine core, the tick loop never waits on the network, and neither side holds the
other: they share channels made first (channels.py). Inbound frames are decoded here and put
on the loop's Inbox; what the loop says is appended to the Outbox (channels.py) and a wake-up
byte goes over an inproc PAIR, after which this thread encodes and sends (while the loop is
inside llama_decode, which releases the GIL); heartbeats and SlotsReports read the
SchedulerStats on the loop's StatsBoard, a frozen snapshot of its latest tick. Sends
never block: a gateway that is gone (EHOSTUNREACH) loses its requests; a slow one (EAGAIN)
loses that message, counted. This thread also answers Hello and Ping and heartbeats every
gateway, and answers SlotsQuery, so liveness and /slots never wait for a tick either.

Whatever reaches the socket is bounded: frames by ZMQ_MAXMSGSIZE, frames buffered per
connection by ZMQ_RCVHWM (then TCP pushes back), the cost of decoding one by the codec's
limits, one turn of receiving by time, and what gateways may have open by GatewayTable.
CURVE (worker/io/curve.py) decides who may connect at all.
"""

from __future__ import annotations

import contextlib
import errno
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import structlog
import zmq

from loomserve.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Cancel,
    DecodeError,
    Embed,
    Embeddings,
    ErrorCode,
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
    VocabFile,
    VocabQuery,
    WorkerError,
    decode,
    encode,
)
from loomserve.protocol.codec import Frame, TooLong, request_id_of
from loomserve.protocol.messages import MAX_EMBED_INPUTS
from loomserve.worker.config import WorkerConfig
from loomserve.worker.io.channels import BROADCAST, Inbox, Outbox, StatsBoard
from loomserve.worker.io.curve import ServerKeys, make_curve_server
from loomserve.worker.io.gateways import GatewayTable
from loomserve.worker.io.handshake import HandshakeWatch

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
LOST_REMEMBERED = 10_000  # lost gateway identities kept to answer with GATEWAY_LOST
MAX_GATEWAYS = 1024  # gateways known at once; a connection flood cannot grow the table
# Arrays and maps in one inbound body: a Generate has four (itself, its prompt, its params,
# their logit_bias), an Embed two and one per input. Past that, a body of nested junk fails
# as soon as it is unpacked instead of growing fifty-fold into empty lists first.
INBOUND_CONTAINERS = MAX_EMBED_INPUTS + 8


@dataclass(slots=True)
class IOCounters:
    """What the IO thread counted; the metrics read these."""

    malformed: int = 0  # frames that did not decode; dropped
    dropped_slow: int = 0  # sends refused with EAGAIN: the gateway reads too slowly
    dropped_gone: int = 0  # sends refused with EHOSTUNREACH: the gateway disconnected
    gateways_lost: int = 0  # gateways given up on (silence or disconnection)
    gateways_refused: int = 0  # messages from new gateways beyond MAX_GATEWAYS; answered, dropped


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
    ) -> None:
        self.config = config
        self.vocab_file = vocab_file  # vocab_file.compressed_metadata, for VocabQuery
        self.inbox = inbox  # where inbound work goes, for the loop
        self.board = board  # what the loop last published, for heartbeats and /slots
        self.model_info = model_info
        self.counters = IOCounters()
        self.ready = True
        self._busy_at = time.monotonic()  # when work was last queued or running here
        self._on_gateways = on_gateways
        self._on_reject = on_reject  # the loop's rejections are counted by the loop
        # No array or map a gateway sends can be longer than a prompt that fits a slot or a
        # logit_bias over the whole vocabulary; longer ones fail at their header.
        self._max_items = max(model_info.slot_context, model_info.vocab_size)
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
        self.outbox = Outbox(self._wake)  # the loop's Sink
        self._gateways = GatewayTable(
            MAX_GATEWAYS, max_open=config.slots + config.max_queue, lost_remembered=LOST_REMEMBERED
        )
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
        self.outbox.flush()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._wake_out.close(linger=0)
        self._wake_in.close(linger=0)
        # The last Finish messages get a moment to leave; a dead gateway cannot hold us.
        self._close_sockets(linger=CLOSE_LINGER_MS)

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
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        interval = self.config.heartbeat_interval
        # Silence is checked ten times per gateway_timeout, so a stalled gateway's slots are
        # freed at most a tenth of the timeout after it (3.3 s with the defaults).
        check_every = min(interval, self.config.gateway_timeout / 10)
        started = time.monotonic()
        next_beat, next_check = started + interval, started + check_every
        while True:
            wait_ms = max(0.0, min(next_beat, next_check) - time.monotonic()) * 1000
            events = dict(poller.poll(timeout=int(wait_ms)))  # pyzmq truncates a float too
            if self._wake_in in events:
                self._drain_wakes()
            if self._router in events:
                self._receive()
            self._send_outbox()
            if self._closing:
                return
            now = time.monotonic()
            if now >= next_check:
                self._expire_silent(now)
                next_check = now + check_every
            if now >= next_beat:
                self._heartbeat()
                next_beat = now + interval

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
            try:
                message = decode(body, self._max_items, INBOUND_CONTAINERS)
            except DecodeError as exc:
                self._reject_undecodable(gateway, body, exc)
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

    def _reject_undecodable(
        self, gateway: bytes, body: Sequence[Frame], error: DecodeError
    ) -> None:
        """A Generate or Embed that did not decode still gets its Rejected, when its id is
        readable: the gateway must not wait for an answer that never comes."""
        request_id = request_id_of(body)
        if request_id is None:
            return
        if isinstance(error, TooLong):
            code = ErrorCode.PROMPT_TOO_LONG
            why = f"longer than any context of this worker ({self._max_items} tokens): {error}"
        else:
            code, why = ErrorCode.INVALID_REQUEST, f"the request did not decode: {error}"
        self._reject(gateway, request_id, code, why)

    def _reject(self, gateway: bytes, request_id: str, code: ErrorCode, why: str) -> None:
        self._send_now(gateway, Rejected(request_id, code.value, why))
        if self._on_reject:
            self._on_reject(code.value)

    def _handle(self, gateway: bytes, message: Message) -> None:
        now = time.monotonic()
        gateways = self._gateways
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
            if not gateways.can_admit(gateway):
                self._refuse_gateway(gateway)
                return
            self._admit(gateway, now)
            log.info("gateway connected", gateway=_name(gateway), gateway_id=message.gateway_id)
            # Not ready while draining or dying: a Hello must not put it back in rotation.
            self._send_now(gateway, replace(self.model_info, ready=self.ready))
            return
        if gateway in gateways.lost:
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
        if isinstance(message, SlotsQuery):
            # Read-only, from a gateway or from any probe: it opens nothing, admits nobody.
            self._send_now(gateway, self._slots_report(message.query_id))
            return
        if isinstance(message, VocabQuery):  # read-only too
            self._send_now(gateway, self._vocab_answer(message.vocab_fingerprint))
            return
        if isinstance(message, Ping) and message.for_gateway:
            # A gateway's keep-alive thread: word from that gateway, if it is one we know.
            kept = message.for_gateway.encode()
            if kept in gateways:
                gateways.admit(kept, now)
            return
        if isinstance(message, Ping) and gateway not in gateways:
            # A probe that never said Hello (`loomserve worker-health`, a readiness wait):
            # answer it, but it is no gateway, so its silence later means nothing.
            self._send_now(gateway, self._heartbeat_message(message.sent_at))
            return
        if not gateways.can_admit(gateway):
            self._refuse_gateway(gateway)
            return
        self._admit(gateway, now)
        if isinstance(message, (Generate, Embed)):  # the loop tells which work it is
            self._busy_at = now
            refusal = gateways.open(gateway, message.request_id)
            if refusal is None:
                self.inbox.submit(gateway, message)
            else:
                self._reject(gateway, message.request_id, *refusal)
        elif isinstance(message, Cancel):
            if gateways.cancel(gateway, message.request_id):
                self.inbox.abort(gateway, message.request_id, message.reason)
        elif isinstance(message, Ping):
            self._send_now(gateway, self._heartbeat_message(message.sent_at))
        else:
            self.counters.malformed += 1
            log.warning("dropped a message only workers send", type=type(message).__name__)

    def _admit(self, gateway: bytes, now: float) -> None:
        new = gateway not in self._gateways
        self._gateways.admit(gateway, now)
        if new and self._on_gateways:
            self._on_gateways(len(self._gateways))

    def _refuse_gateway(self, gateway: bytes) -> None:
        self.counters.gateways_refused += 1
        if self.counters.gateways_refused % 1000 == 1:
            log.warning(
                "refused a gateway: too many connected",
                gateway=_name(gateway),
                max_gateways=MAX_GATEWAYS,
                refused=self.counters.gateways_refused,
            )
        self._send_now(
            gateway,
            WorkerError(
                ErrorCode.QUEUE_FULL.value,
                f"this worker serves {MAX_GATEWAYS} gateways already; say Hello again later",
            ),
        )

    def _send_outbox(self) -> None:
        outbox, gateways = self.outbox.messages, self._gateways
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
                log.warning("gateway too slow; dropped a message", gateway=_name(gateway))
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.counters.dropped_gone += 1
            self._lose(gateway, "it disconnected")

    def _expire_silent(self, now: float) -> None:
        timeout = self.config.gateway_timeout
        for gateway in self._gateways.silent(now, timeout):
            self._lose(gateway, f"it was silent for {timeout:g}s")

    def _heartbeat(self) -> None:
        beat = self._heartbeat_message(0.0)
        for gateway in list(self._gateways.known):
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

    def _lose(self, gateway: bytes, why: str) -> None:
        state = self._gateways.known.get(gateway)
        if state is None or not self._gateways.lose(gateway):
            return
        self.counters.gateways_lost += 1
        if state.open:
            log.warning(
                "gateway lost; cancelling its requests",
                gateway=_name(gateway),
                why=why,
                requests=len(state.open),
            )
        else:  # a gateway that stopped cleanly, its streams drained: nothing was lost
            log.info("gateway gone", gateway=_name(gateway), why=why)
        self.inbox.gateway_gone(
            gateway, f"the worker cancelled this request: its gateway was lost ({why})"
        )
        if self._on_gateways:
            self._on_gateways(len(self._gateways))


def _name(identity: bytes) -> str:
    return identity.decode(errors="replace")
