"""The gateways the IO thread knows, what each has open, and what each of their messages gets,
bounded however a peer behaves. No zmq here: the socket thread (sockets.py) receives and
sends; the GatewayDesk decodes what came and deals with it, the GatewayTable keeps count.

A gateway is a ROUTER identity: a peer gets one per connection it opens, and may send as many
Generates and Cancels as it likes. The GatewayTable caps both. At most max_gateways are known at
once (silent ones expire); each may have max_open requests between its Generate and their
Finish or Rejected, and as many Generates for an id already open (the loop rejects those, in
order after the original's Accepted); a Cancel reaches the loop only for an open request,
and only once. So the loop's inbox holds at most max_gateways x 3 x max_open items.

The desk answers Hello, the queries (SlotsQuery, VocabQuery) and Pings itself, through its
socket thread's Replies, so liveness and /slots never wait for a tick; a Generate, an Embed
and a Cancel go on to the loop's Inbox, and a gateway given up on has its requests cancelled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from ...protocol import (
    PROTOCOL_VERSION,
    Cancel,
    DecodeError,
    Embed,
    ErrorCode,
    Generate,
    Heartbeat,
    Hello,
    ImageTokens,
    ImageTokensQuery,
    Message,
    ModelInfo,
    Ping,
    Rejected,
    SlotsQuery,
    SlotsReport,
    VocabFile,
    VocabQuery,
    WorkerError,
    decode,
)
from ...protocol.codec import Frame, TooLong, request_id_of
from ...protocol.messages import MAX_EMBED_INPUTS
from .channels import Inbox

log = structlog.get_logger("loomserve.worker.io.sockets")  # the logger these lines always had

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


@dataclass(slots=True)
class GatewayState:
    """One known gateway."""

    last_seen: float
    open: set[str] = field(default_factory=set)  # handed to the loop; no Finish/Rejected yet
    cancelled: set[str] = field(default_factory=set)  # open ones a Cancel was passed on for
    duplicates: int = 0  # Generates for an open id, passed on for the loop to reject in order


class GatewayTable:
    """Known gateways, the ones given up on, and each one's open requests."""

    def __init__(self, max_gateways: int, max_open: int, lost_remembered: int) -> None:
        self.max_gateways = max_gateways
        self.max_open = max_open
        self.lost_remembered = lost_remembered
        self.known: dict[bytes, GatewayState] = {}
        self.lost: dict[bytes, None] = {}  # given up on, until they say Hello again

    def __len__(self) -> int:
        return len(self.known)

    def __contains__(self, gateway: bytes) -> bool:
        return gateway in self.known

    def can_admit(self, gateway: bytes) -> bool:
        """Whether admit() would take this gateway: known already, or room for one more."""
        return gateway in self.known or len(self.known) < self.max_gateways

    def admit(self, gateway: bytes, now: float) -> None:
        """It spoke: know it (check can_admit first), forgive it if it was lost."""
        state = self.known.get(gateway)
        if state is None:
            self.known[gateway] = GatewayState(last_seen=now)
            self.lost.pop(gateway, None)
        else:
            state.last_seen = now

    def open(self, gateway: bytes, request_id: str) -> tuple[ErrorCode, str] | None:
        """Record a Generate of a known gateway for the loop; why to reject it now, or None.

        A duplicate id goes on to the loop too: its Rejected then follows the original's
        Accepted, as the gateway expects of one id."""
        state = self.known[gateway]
        duplicate = request_id in state.open
        held = state.duplicates if duplicate else len(state.open)
        if held >= self.max_open:
            return (
                ErrorCode.QUEUE_FULL,
                f"this gateway has {len(state.open)} requests open, as many as the worker "
                "holds running and queued",
            )
        if duplicate:
            state.duplicates += 1
        else:
            state.open.add(request_id)
        return None

    def cancel(self, gateway: bytes, request_id: str) -> bool:
        """Whether a Cancel should reach the loop: an open request, not cancelled yet."""
        state = self.known.get(gateway)
        if state is None or request_id not in state.open or request_id in state.cancelled:
            return False
        state.cancelled.add(request_id)
        return True

    def close(self, gateway: bytes, request_id: str, duplicate: bool = False) -> None:
        """The loop finished or rejected the request (duplicate: rejected a second Generate
        for an id still open, which stays open)."""
        state = self.known.get(gateway)
        if state is None:
            return
        if duplicate:
            state.duplicates = max(0, state.duplicates - 1)
        else:
            state.open.discard(request_id)
            state.cancelled.discard(request_id)

    def silent(self, now: float, timeout: float) -> list[bytes]:
        """Known gateways that said nothing for longer than timeout."""
        return [gw for gw, state in self.known.items() if now - state.last_seen > timeout]

    def lose(self, gateway: bytes) -> bool:
        """Give up on a gateway (its requests are the loop's to cancel); False if unknown."""
        if self.known.pop(gateway, None) is None:
            return False
        self.lost[gateway] = None
        if len(self.lost) > self.lost_remembered:
            del self.lost[next(iter(self.lost))]
        return True


@dataclass(frozen=True, slots=True)
class Replies:
    """What the desk answers with, from its socket thread (sockets.WorkerIO): the send of one
    message to one gateway, never blocking, and the answers built from the thread's state."""

    send: Callable[[bytes, Message], None]
    hello: Callable[[], ModelInfo]  # this worker, ready or not
    heartbeat: Callable[[float], Heartbeat]  # the answer to a Ping sent at that time
    slots_report: Callable[[str], SlotsReport]
    vocab: Callable[[str], VocabFile]  # the vocabulary of that fingerprint, or why not


class GatewayDesk:
    """Deals with every message the gateways send, and with gateways that go silent or away."""

    def __init__(
        self,
        inbox: Inbox,
        replies: Replies,
        max_items: int,
        max_open: int,
        on_gateways: Callable[[int], None] | None = None,
        on_reject: Callable[[str], None] | None = None,
        count_images: Callable[[bytes, ImageTokensQuery], None] | None = None,
    ) -> None:
        self.inbox = inbox  # where inbound work goes, for the loop
        # The media encoder's submit_count (its thread answers), None without a projector.
        self.count_images = count_images
        self.replies = replies
        self.counters = IOCounters()
        self.table = GatewayTable(MAX_GATEWAYS, max_open, LOST_REMEMBERED)
        # No array or map a gateway sends can be longer than this (a prompt that fits a slot,
        # a logit_bias over the whole vocabulary); longer ones fail at their header.
        self.max_items = max_items
        self._on_gateways = on_gateways
        self._on_reject = on_reject  # the loop's rejections are counted by the loop

    def receive(self, gateway: bytes, body: Sequence[Frame], now: float) -> bool:
        """Decode a message and deal with it; whether it was work for the loop."""
        try:
            message = decode(body, self.max_items, INBOUND_CONTAINERS)
        except DecodeError as exc:
            self._reject_undecodable(gateway, body, exc)
            self.counters.malformed += 1
            if self.counters.malformed % 1000 == 1:  # the first, then every 1000th
                log.warning(
                    "dropped a malformed message",
                    gateway=name_of(gateway),
                    error=str(exc),
                    malformed=self.counters.malformed,
                )
            return False
        return self.handle(gateway, message, now)

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
            why = f"longer than any context of this worker ({self.max_items} tokens): {error}"
        else:
            code, why = ErrorCode.INVALID_REQUEST, f"the request did not decode: {error}"
        self._reject(gateway, request_id, code, why)

    def _reject(self, gateway: bytes, request_id: str, code: ErrorCode, why: str) -> None:
        self.replies.send(gateway, Rejected(request_id, code.value, why))
        if self._on_reject:
            self._on_reject(code.value)

    def handle(self, gateway: bytes, message: Message, now: float) -> bool:
        """Answer a decoded message or pass it on to the loop; whether it was work for it."""
        gateways, send = self.table, self.replies.send
        if isinstance(message, Hello):
            if message.protocol_version != PROTOCOL_VERSION:
                send(
                    gateway,
                    WorkerError(
                        ErrorCode.PROTOCOL_MISMATCH.value,
                        f"this worker speaks protocol {PROTOCOL_VERSION}, "
                        f"the gateway {message.protocol_version}",
                    ),
                )
                return False
            if not gateways.can_admit(gateway):
                self._refuse_gateway(gateway)
                return False
            if self._admit(gateway, now):  # a gateway says Hello again until it hears back
                log.info(
                    "gateway connected", gateway=name_of(gateway), gateway_id=message.gateway_id
                )
            # Not ready while draining or dying: a Hello must not put it back in rotation.
            send(gateway, self.replies.hello())
            return False
        if gateway in gateways.lost:
            # Its requests were cancelled when it went silent; it must start over.
            send(
                gateway,
                WorkerError(
                    ErrorCode.GATEWAY_LOST.value,
                    "this gateway was silent too long and its requests were cancelled; "
                    "say Hello again",
                ),
            )
            return False
        if isinstance(message, SlotsQuery):
            # Read-only, from a gateway or from any probe: it opens nothing, admits nobody.
            send(gateway, self.replies.slots_report(message.query_id))
            return False
        if isinstance(message, VocabQuery):  # read-only too
            send(gateway, self.replies.vocab(message.vocab_fingerprint))
            return False
        if isinstance(message, Ping) and message.for_gateway:
            # A gateway's keep-alive thread: word from that gateway, if it is one we know.
            kept = message.for_gateway.encode()
            if kept in gateways:
                gateways.admit(kept, now)
            return False
        if isinstance(message, Ping) and gateway not in gateways:
            # A probe that never said Hello (`loomserve worker-health`, a readiness wait):
            # answer it, but it is no gateway, so its silence later means nothing.
            send(gateway, self.replies.heartbeat(message.sent_at))
            return False
        if not gateways.can_admit(gateway):
            self._refuse_gateway(gateway)
            return False
        self._admit(gateway, now)
        if isinstance(message, ImageTokensQuery):  # a gateway's only: reading images costs
            if self.count_images is None:
                why = "this worker reads no images (it has no --mmproj)"
                send(gateway, ImageTokens(message.query_id, [], why))
            else:
                self.count_images(gateway, message)
            return False
        if isinstance(message, (Generate, Embed)):  # the loop tells which work it is
            refusal = gateways.open(gateway, message.request_id)
            if refusal is None:
                self.inbox.submit(gateway, message)
            else:
                self._reject(gateway, message.request_id, *refusal)
            return True
        if isinstance(message, Cancel):
            if gateways.cancel(gateway, message.request_id):
                self.inbox.abort(gateway, message.request_id, message.reason)
        elif isinstance(message, Ping):
            send(gateway, self.replies.heartbeat(message.sent_at))
        else:
            self.counters.malformed += 1
            log.warning("dropped a message only workers send", type=type(message).__name__)
        return False

    def _admit(self, gateway: bytes, now: float) -> bool:
        """Admit the gateway (again); whether it is new."""
        new = gateway not in self.table
        self.table.admit(gateway, now)
        if new and self._on_gateways:
            self._on_gateways(len(self.table))
        return new

    def _refuse_gateway(self, gateway: bytes) -> None:
        self.counters.gateways_refused += 1
        if self.counters.gateways_refused % 1000 == 1:
            log.warning(
                "refused a gateway: too many connected",
                gateway=name_of(gateway),
                max_gateways=MAX_GATEWAYS,
                refused=self.counters.gateways_refused,
            )
        self.replies.send(
            gateway,
            WorkerError(
                ErrorCode.QUEUE_FULL.value,
                f"this worker serves {MAX_GATEWAYS} gateways already; say Hello again later",
            ),
        )

    def expire_silent(self, now: float, timeout: float) -> None:
        """Give up on the gateways that said nothing for longer than timeout."""
        for gateway in self.table.silent(now, timeout):
            self.lose(gateway, f"it was silent for {timeout:g}s")

    def lose(self, gateway: bytes, why: str) -> None:
        """Give up on a gateway: the loop cancels its requests, saying why."""
        state = self.table.known.get(gateway)
        if state is None or not self.table.lose(gateway):
            return
        self.counters.gateways_lost += 1
        if state.open:
            log.warning(
                "gateway lost; cancelling its requests",
                gateway=name_of(gateway),
                why=why,
                requests=len(state.open),
            )
        else:  # a gateway that stopped cleanly, its streams drained: nothing was lost
            log.info("gateway gone", gateway=name_of(gateway), why=why)
        self.inbox.gateway_gone(
            gateway, f"the worker cancelled this request: its gateway was lost ({why})"
        )
        if self._on_gateways:
            self._on_gateways(len(self.table))


def name_of(identity: bytes) -> str:
    """A gateway's identity, for the log."""
    return identity.decode(errors="replace")
