"""What the IO thread and the tick loop share, created before either (as vLLM v1's EngineCore
shares queues with its input and output threads): the inbox the loop reads and IO writes, and
the SchedulerStats the loop publishes after each tick on the StatsBoard, which IO reads for
heartbeats and /slots and the metrics at scrape time (a frozen snapshot, stats.py: no other
thread touches the scheduler's live slots). The third channel, what the loop says, is a Sink:
in a worker process the IO thread's Outbox (sockets.py), whose messages wait in a deque until
a wake-up stirs the thread's poll; a tick sends one Outputs per gateway at its end
(sched/scheduler.py's PendingOutputs). Neither side holds the other. Plain Python.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Protocol

from ...protocol import Embed, FinishReason, Generate, Load, Message
from ..stats import SchedulerStats

Work = Generate | Embed  # a request for the loop: the tick generates, the embedder embeds


@dataclass(frozen=True, slots=True)
class Submit:
    gateway: bytes
    message: Work


@dataclass(frozen=True, slots=True)
class Abort:
    """A gateway's Cancel (the wire message) of one request, for the loop."""

    gateway: bytes
    request_id: str
    reason: FinishReason = FinishReason.CANCELLED  # the gateway's (protocol Cancel.reason)


@dataclass(frozen=True, slots=True)
class GatewayGone:
    gateway: bytes
    why: str


@dataclass(frozen=True, slots=True)
class Encoded:
    """A Generate whose images the media encoder has read and encoded (worker/engine/media.py):
    `prompt` is an EncodedPrompt, or None when it failed, and `why` says why."""

    gateway: bytes
    message: Generate
    prompt: object
    why: str = ""


@dataclass(frozen=True, slots=True)
class Compiled:
    """A Generate whose grammar the grammar compiler has compiled (grammar_compiler.py):
    `grammar` is a GrammarState, or None when it cannot be used, and `why` says why; `carry`
    is what the loop gave the compiler with it."""

    gateway: bytes
    message: Generate
    carry: object
    grammar: object
    why: str
    seconds: float


STOP = object()

Item = Submit | Abort | GatewayGone | Encoded | Compiled | object  # object: STOP


class Inbox:
    """Work for the loop, from any thread; the loop blocks on it whenever it has nothing to do."""

    def __init__(self) -> None:
        # SimpleQueue: its put() is reentrant, so stop() may run in a signal handler that
        # interrupted this thread inside get(). A queue.Queue's lock was held there, and a
        # SIGTERM landing in it hung the worker for good (seen in CI: a scaled-in worker).
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def submit(self, gateway: bytes, message: Work) -> None:
        self._queue.put(Submit(gateway, message))

    def abort(self, gateway: bytes, request_id: str, reason: str = FinishReason.CANCELLED) -> None:
        self._queue.put(Abort(gateway, request_id, FinishReason(reason)))

    def gateway_gone(self, gateway: bytes, why: str) -> None:
        """The gateway vanished: cancel its queued and running requests, saying why."""
        self._queue.put(GatewayGone(gateway, why))

    def encoded(self, gateway: bytes, message: Generate, prompt: object, why: str) -> None:
        """The media encoder's result for a Generate with images (from its thread)."""
        self._queue.put(Encoded(gateway, message, prompt, why))

    def compiled(
        self,
        gateway: bytes,
        message: Generate,
        carry: object,
        grammar: object,
        why: str,
        seconds: float,
    ) -> None:
        """The grammar compiler's result for a Generate with a grammar (from its thread)."""
        self._queue.put(Compiled(gateway, message, carry, grammar, why, seconds))

    def stop(self) -> None:
        """Drain: refuse new requests, give the others the shutdown timeout, then return."""
        self._queue.put(STOP)

    def get(self, block: bool) -> Item | None:
        """The next item; None when there is none (and block is False)."""
        try:
            return self._queue.get(block=block)
        except queue.Empty:
            return None

    def empty(self) -> bool:
        return self._queue.empty()


class StatsBoard:
    """The latest SchedulerStats: the loop replaces it whole (one reference, so a reader on
    another thread sees one tick's stats or the next one's, never a mix)."""

    def __init__(self, slots: int) -> None:
        self.latest = SchedulerStats(Load(0, free_slots=slots, running=0), n_slots=slots)

    def publish(self, stats: SchedulerStats) -> None:
        """The loop thread's call, after each tick."""
        self.latest = stats


class Sink(Protocol):
    """Where the loop's messages go: the IO thread's outbox, or a list in a test."""

    def send(self, gateway: bytes, message: Message) -> None: ...

    def flush(self) -> None: ...
