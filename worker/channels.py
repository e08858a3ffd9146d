"""What the IO thread and the tick loop share, created before either (as vLLM v1's EngineCore
shares queues with its input and output threads): the inbox the loop reads and IO writes, and
the load the loop publishes after each tick and IO reads for heartbeats. The third channel,
the outbox the loop writes and IO drains, is a Sink (outputs.py): outbox.py's Outbox, which wakes
the IO thread's poll. Neither side holds the other. Plain Python.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from loomserve.protocol import Embed, FinishReason, Generate
from loomserve.worker.prefix_cache import advertised_keys
from loomserve.worker.scheduler import Scheduler

Work = Generate | Embed  # a request for the loop: the tick generates, the embedder embeds


@dataclass(frozen=True, slots=True)
class Submit:
    gateway: bytes
    message: Work


@dataclass(frozen=True, slots=True)
class Cancel:
    gateway: bytes
    request_id: str
    reason: FinishReason = FinishReason.CANCELLED  # the gateway's (protocol Cancel.reason)


@dataclass(frozen=True, slots=True)
class GatewayGone:
    gateway: bytes
    why: str


STOP = object()

Item = Submit | Cancel | GatewayGone | object  # object: STOP


class Inbox:
    """Work for the loop, from any thread; the loop blocks on it whenever it has nothing to do."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Item] = queue.Queue()

    def submit(self, gateway: bytes, message: Work) -> None:
        self._queue.put(Submit(gateway, message))

    def cancel(self, gateway: bytes, request_id: str, reason: str = FinishReason.CANCELLED) -> None:
        self._queue.put(Cancel(gateway, request_id, FinishReason(reason)))

    def gateway_gone(self, gateway: bytes, why: str) -> None:
        """The gateway vanished: cancel its queued and running requests, saying why."""
        self._queue.put(GatewayGone(gateway, why))

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


@dataclass(frozen=True, slots=True)
class Load:
    """The loop's load after its latest tick; the IO thread reads it for heartbeats."""

    queue_depth: int
    free_slots: int
    running: int
    tenants: dict[str, tuple[int, int]] = field(default_factory=dict)  # (running, waiting)
    prefixes: tuple[int, ...] = ()  # keys of the cached prompts, for routing (prefix_cache.py)
    kv_cells_used: int = 0  # KV cells holding tokens, running and reusable


class LoadBoard:
    """The latest Load: the loop replaces it whole (one reference, so a reader on another
    thread sees one tick's Load or the next one's, never a mix)."""

    def __init__(self, slots: int) -> None:
        self.latest = Load(queue_depth=0, free_slots=slots, running=0)
        self._prefixes: tuple[int, ...] = ()  # advertised in heartbeats; see Load.prefixes
        self._prefixes_at = -float("inf")

    def publish(self, scheduler: Scheduler, prefixes_every: float) -> None:
        """The scheduler's load now (the loop thread's call, after each tick)."""
        self.latest = Load(
            scheduler.queue_depth,
            scheduler.free_slots,
            scheduler.running,
            scheduler.waiting.counts(),
            self._advertised_prefixes(scheduler, prefixes_every),
            sum(slot.n_in_cache for slot in scheduler.slots),
        )

    def _advertised_prefixes(self, scheduler: Scheduler, every: float) -> tuple[int, ...]:
        """The cached prompts' keys, recomputed at most once per heartbeat interval: routing
        needs no fresher view, and hashing every cached sequence each tick would cost."""
        now = time.monotonic()
        if now - self._prefixes_at >= every:
            self._prefixes_at = now
            self._prefixes = tuple(advertised_keys(scheduler.slots, scheduler.ram))
        return self._prefixes
