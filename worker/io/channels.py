"""What the IO thread and the tick loop share, created before either (as vLLM v1's EngineCore
shares queues with its input and output threads): the inbox the loop reads and IO writes, and
the load the loop publishes after each tick and IO reads for heartbeats and /slots (a frozen
snapshot: no other thread touches the scheduler's live slots). The third channel,
the outbox the loop writes and IO drains, is a Sink: outbox.py's Outbox, which wakes the IO
thread's poll; a tick fills one Outputs per gateway (PendingOutputs) and sends them together at
its end. Neither side holds the other. Plain Python.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from loomserve.protocol import (
    Embed,
    FinishReason,
    Generate,
    Message,
    Outputs,
    SlotState,
    TenantQueue,
)
from loomserve.worker.cache.prefix_cache import advertised_keys
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.sched.slots import Slot
from loomserve.worker.sched.strategies import SlotPhase

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


class SlotSnapshot(NamedTuple):
    """One busy slot as a tick left it: counts and times, copied out of the live Slot and
    Request so that the IO thread can report it (SlotsReport) while the loop goes on.

    A NamedTuple, immutable like a frozen dataclass but built several times faster: the loop
    copies every busy slot on every tick.
    """

    slot: int  # its index (not `index`: a tuple has that method)
    phase: SlotPhase
    request_id: str
    gateway: bytes
    tenant: str
    priority: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int  # prompt tokens this request evaluated, besides the cached ones
    generated_tokens: int
    arrived_at: float  # time.monotonic(), as Request
    first_token_at: float  # 0.0 before the first token

    @classmethod
    def of(cls, slot: Slot) -> SlotSnapshot:
        """A busy slot's copy (plain attribute reads: this runs per busy slot per tick)."""
        request = slot.occupant
        gateway, request_id = request.key
        prompt = len(request.prompt)
        return cls(
            slot.index,
            slot.phase,
            request_id,
            gateway,
            request.tenant,
            request.priority,
            prompt,
            request.cached_tokens,
            max(0, min(slot.n_in_cache, prompt) - request.cached_tokens),
            request.completion_tokens,
            request.arrived_at,
            request.first_token_at,
        )

    def state(self, now: float) -> SlotState:
        """Its wire form at time.monotonic() `now`: ages and rates from the copied times."""
        rate = 0.0
        if self.first_token_at and self.generated_tokens > 1 and now > self.first_token_at:
            # The first token came with the prompt's evaluation: the rate counts those after it.
            rate = (self.generated_tokens - 1) / (now - self.first_token_at)
        return SlotState(
            index=self.slot,
            state=self.phase.value,
            request_id=self.request_id,
            gateway=self.gateway.decode(errors="replace"),
            tenant=self.tenant,
            priority=self.priority,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            computed_tokens=self.computed_tokens,
            generated_tokens=self.generated_tokens,
            age_seconds=max(0.0, now - self.arrived_at),
            tokens_per_second=rate,
        )


@dataclass(frozen=True, slots=True)
class Load:
    """The loop's load after its latest tick; the IO thread reads it for heartbeats and for
    SlotsReport."""

    queue_depth: int
    free_slots: int
    running: int
    tenants: dict[str, tuple[int, int]] = field(default_factory=dict)  # (running, waiting)
    prefixes: tuple[int, ...] = ()  # keys of the cached prompts, for routing (prefix_cache.py)
    kv_cells_used: int = 0  # KV cells holding tokens, running and reusable
    n_slots: int = 0
    busy: tuple[SlotSnapshot, ...] = ()  # the busy slots, by index; the others are idle

    def slot_states(self, now: float) -> list[SlotState]:
        """Every slot's wire form, idle ones included, in index order."""
        busy = {snapshot.slot: snapshot for snapshot in self.busy}
        return [
            busy[index].state(now) if index in busy else SlotState(index, SlotPhase.IDLE.value)
            for index in range(self.n_slots)
        ]

    def tenant_queues(self) -> list[TenantQueue]:
        return [TenantQueue(name, *counts) for name, counts in sorted(self.tenants.items())]


class LoadBoard:
    """The latest Load: the loop replaces it whole (one reference, so a reader on another
    thread sees one tick's Load or the next one's, never a mix)."""

    def __init__(self, slots: int) -> None:
        self.latest = Load(queue_depth=0, free_slots=slots, running=0, n_slots=slots)
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
            len(scheduler.slots),
            # Only the busy slots are copied: an idle one has nothing to say but its index.
            tuple(SlotSnapshot.of(slot) for slot in scheduler.slots if slot.request is not None),
        )

    def _advertised_prefixes(self, scheduler: Scheduler, every: float) -> tuple[int, ...]:
        """The cached prompts' keys, recomputed at most once per heartbeat interval: routing
        needs no fresher view, and hashing every cached sequence each tick would cost."""
        now = time.monotonic()
        if now - self._prefixes_at >= every:
            self._prefixes_at = now
            self._prefixes = tuple(advertised_keys(scheduler.slots, scheduler.ram))
        return self._prefixes


class Sink(Protocol):
    """Where the loop's messages go: the IO thread's outbox, or a list in a test."""

    def send(self, gateway: bytes, message: Message) -> None: ...

    def flush(self) -> None: ...


class PendingOutputs:
    """This tick's Outputs, by gateway."""

    def __init__(self) -> None:
        self._by_gateway: dict[bytes, Outputs] = {}

    def to(self, gateway: bytes) -> Outputs:
        outputs = self._by_gateway.get(gateway)
        if outputs is None:
            outputs = self._by_gateway[gateway] = Outputs(tokens=[], finishes=[])
        return outputs

    def send(self, sink: Sink) -> None:
        """Send every gateway its Outputs, if any, and start over."""
        if self._by_gateway:
            for gateway, outputs in self._by_gateway.items():
                sink.send(gateway, outputs)
            self._by_gateway = {}
            sink.flush()
