"""WorkerPool: the gateway's connections to every worker, and which one gets each request.

It owns one WorkerClient per worker address and keeps that set in step with the configured
endpoints: host names are looked up again every RESOLVE_SECONDS (in a thread, off the event
loop), a new address gets a client, and an address that no longer resolves takes no new
requests and is closed once its open requests end. A worker is in rotation while its client
says it can serve (connected, heartbeating, ready, same vocabulary); the client takes care of
saying Hello again, so a worker that comes back rejoins by itself.

Each request goes where routing.py's policy says. A worker that cannot take it (unavailable,
queue full, not ready, lost before it confirmed) costs one more try on another worker; a
request goes to MAX_WORKERS_PER_REQUEST workers at most, counting the resend of a request
whose worker was lost before its first token (generation.py does that).

To the HTTP app the pool looks like one worker: ready while any worker is, the ModelInfo of
the ready ones, their load summed.
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import zmq.asyncio

from loomserve.gateway.client import RequestHandle, WorkerClient, gateway_identity, stop_tasks
from loomserve.gateway.config import GatewayConfig
from loomserve.gateway.endpoints import expand, needs_resolving
from loomserve.gateway.metrics import GatewayMetrics
from loomserve.gateway.routing import (
    Choice,
    PrefixAffinity,
    WorkerLoad,
    choose_worker,
    preferred_worker,
    prefix_key,
)
from loomserve.gateway.worker_errors import (
    WorkerClientError,
    WorkerLost,
    WorkerRejected,
    WorkerUnavailable,
)
from loomserve.protocol.messages import (
    Embed,
    Embeddings,
    ErrorCode,
    Generate,
    Heartbeat,
    ModelInfo,
)
from loomserve.protocol.prefix_keys import prefix_keys

log = structlog.get_logger(__name__)

RESOLVE_SECONDS = 5.0  # how often host names are looked up again
WATCH_SECONDS = 0.25  # how often rotation changes are logged and the metrics refreshed
MAX_WORKERS_PER_REQUEST = 2  # the first worker, and one other when the first fails it
# Refusals another worker may not share; the others (prompt too long...) any worker repeats.
RETRYABLE_REJECTIONS = frozenset({ErrorCode.QUEUE_FULL, ErrorCode.NOT_READY})


@dataclass(slots=True)
class Member:
    """One worker address and the gateway's connection to it."""

    client: WorkerClient
    up: bool = False  # in rotation at the latest watch (for logs and metrics)
    retiring: bool = False  # its address no longer resolves: no new requests, closed when idle


class WorkerPool:
    """Every worker connection of one gateway; routes each request to one of them."""

    def __init__(
        self,
        config: GatewayConfig,
        vocab_size: int,
        vocab_fingerprint: str,
        metrics: GatewayMetrics | None = None,
        resolver: Callable[[str], list[str]] = expand,
    ) -> None:
        self.config = config
        self.identity = gateway_identity()  # each worker connection adds a serial number
        self.vocab_size = vocab_size
        self.vocab_fingerprint = vocab_fingerprint
        self.metrics = metrics
        self.members: dict[str, Member] = {}  # by worker address
        self.affinity = PrefixAffinity()
        self._resolver = resolver
        self._resolved: dict[str, list[str]] = {}  # configured endpoint -> its addresses
        self._resolve_errors: dict[str, str] = {}  # configured endpoint -> why it did not resolve
        self._serial = 0
        self._context = zmq.asyncio.Context()  # one IO thread for all worker sockets
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the endpoints, connect to every worker, start watching them."""
        await self.resolve()
        self._tasks = [asyncio.create_task(self._watch_loop(), name="workers-watch")]
        if any(needs_resolving(endpoint) for endpoint in self.config.workers):
            self._tasks.append(asyncio.create_task(self._resolve_loop(), name="workers-resolve"))

    async def wait_for_worker(self, timeout: float) -> bool:
        """Wait up to timeout for any worker's first answer; whether one came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not any(member.client.answered for member in self.members.values()):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def close(self) -> None:
        """Stop the loops and close every worker connection (open requests end)."""
        await stop_tasks(self._tasks)
        self._tasks = []
        for member in self.members.values():
            await member.client.close()
        self.members.clear()
        self._context.destroy(linger=0)

    # --- state -------------------------------------------------------------------

    def in_rotation(self) -> list[WorkerClient]:
        """The clients of the workers that can take requests now."""
        return [
            member.client
            for member in self.members.values()
            if not member.retiring and member.client.unavailable_reason() is None
        ]

    def counts(self) -> tuple[int, int]:
        """(workers in rotation, workers known)."""
        known = sum(not member.retiring for member in self.members.values())
        return len(self.in_rotation()), known

    def unavailable_reason(self) -> str | None:
        """Why no request can be served now; None while at least one worker can take one."""
        reasons: dict[str, str] = {}
        for endpoint, member in self.members.items():
            if member.retiring:
                continue
            reason = member.client.unavailable_reason()
            if reason is None:
                return None
            reasons[endpoint] = reason
        if not reasons:
            errors = "; ".join(f"{e}: {why}" for e, why in self._resolve_errors.items())
            return f"no worker address resolves ({errors})" if errors else "no worker is known"
        if len(reasons) == 1:
            return next(iter(reasons.values()))
        listed = "; ".join(f"{endpoint}: {reason}" for endpoint, reason in reasons.items())
        return f"none of the {len(reasons)} workers can take requests ({listed})"

    @property
    def info(self) -> ModelInfo | None:
        """A ready worker's ModelInfo: the one with the smallest slot context, to be safe."""
        infos = [client.info for client in self.in_rotation() if client.info is not None]
        return min(infos, key=lambda info: info.slot_context) if infos else None

    @property
    def heartbeat(self) -> Heartbeat | None:
        """The ready workers' latest heartbeats, summed; None while none is ready.

        A worker that answered Hello but has not heartbeated yet counts as idle, as in routing.
        """
        beats = [_latest_load(client) for client in self.in_rotation() if client.info]
        if not beats:
            return None
        return Heartbeat(
            sent_at=max(beat.sent_at for beat in beats),
            ping_sent_at=0.0,
            ready=True,
            queue_depth=sum(beat.queue_depth for beat in beats),
            free_slots=sum(beat.free_slots for beat in beats),
            running=sum(beat.running for beat in beats),
        )

    # --- requests ------------------------------------------------------------------

    async def submit(
        self, generate: Generate, deadline: float, tried: set[str]
    ) -> tuple[WorkerClient, RequestHandle]:
        """Send a Generate to the best worker not in `tried`, and a second one if it fails.

        `tried` holds the workers this request went to; each attempt adds one. Raises the
        last worker's error (or WorkerUnavailable) when no worker took the request.
        """
        key = prefix_key(generate.prompt_tokens)
        keys = prefix_keys(generate.prompt_tokens)
        error: WorkerClientError | None = None
        while len(tried) < MAX_WORKERS_PER_REQUEST:
            picked = self._pick(key, tried, keys)
            if picked is None:
                break
            member, choice = picked
            if tried:
                self._count_reroute(error)
            tried.add(choice.endpoint)
            try:
                handle = await member.client.submit(generate, deadline)
            except (WorkerUnavailable, WorkerLost) as exc:
                error = exc
                continue
            except WorkerRejected as exc:
                if exc.code not in RETRYABLE_REJECTIONS:
                    raise
                error = exc
                continue
            self._routed(choice, key, member.client)
            return member.client, handle
        if error is not None:
            raise error
        raise WorkerUnavailable(self.unavailable_reason() or "no other worker can take it")

    async def embed(self, embed: Embed) -> Embeddings:
        """Send an Embed to the worker with the most headroom, and to a second if it fails."""
        tried: set[str] = set()
        error: WorkerClientError | None = None
        while len(tried) < MAX_WORKERS_PER_REQUEST:
            picked = self._pick(None, tried)
            if picked is None:
                break
            member, choice = picked
            tried.add(choice.endpoint)
            try:
                return await member.client.embed(embed)
            except (WorkerUnavailable, WorkerLost) as exc:
                error = exc
        if error is not None:
            raise error
        raise WorkerUnavailable(self.unavailable_reason() or "no worker can take it")

    def in_use(self, request_id: str) -> bool:
        """Whether a request with this id is open on any worker (ids are unique per gateway)."""
        return any(member.client.in_use(request_id) for member in self.members.values())

    def _pick(
        self, key: int | None, tried: set[str], keys: list[int] | None = None
    ) -> tuple[Member, Choice] | None:
        loads = []
        advertised: dict[str, list[int]] = {}
        for endpoint, member in self.members.items():
            client = member.client
            if endpoint in tried or member.retiring or client.info is None:
                continue
            if client.unavailable_reason() is not None:
                continue
            beat = _latest_load(client)
            loads.append(
                WorkerLoad(
                    endpoint,
                    client.info.slots,
                    beat.free_slots,
                    beat.queue_depth,
                    client.pending_requests,
                    client.open_requests,
                )
            )
            if keys:
                advertised[endpoint] = beat.prefixes
        if not loads:
            return None
        random.shuffle(loads)  # ties go to a random worker, not always the first listed
        preferred = preferred_worker(self.affinity.owner(key), keys or [], advertised)
        choice = choose_worker(loads, preferred)
        return self.members[choice.endpoint], choice

    def _routed(self, choice: Choice, key: int | None, client: WorkerClient) -> None:
        self.affinity.record(key, choice.endpoint)
        if self.metrics is not None:
            self.metrics.worker_requests_routed.labels(choice.endpoint).inc()
            self.metrics.worker_requests_in_flight.labels(choice.endpoint).set(client.open_requests)
            if choice.affinity:
                self.metrics.worker_prefix_affinity_hits.labels(choice.endpoint).inc()

    def _count_reroute(self, error: WorkerClientError | None) -> None:
        if self.metrics is None:
            return
        # No error in this call: generation.py resends a request whose worker was lost.
        reason = "lost" if error is None or isinstance(error, WorkerLost) else "refused"
        self.metrics.requests_rerouted.labels(reason).inc()

    # --- the set of workers ----------------------------------------------------------

    async def resolve(self) -> None:
        """Look the endpoints up again and connect to new addresses, retire vanished ones."""
        for endpoint in self.config.workers:
            try:
                addresses = await asyncio.to_thread(self._resolver, endpoint)
            except OSError as exc:
                if endpoint not in self._resolve_errors:
                    log.warning(
                        "worker endpoint does not resolve", endpoint=endpoint, error=str(exc)
                    )
                self._resolve_errors[endpoint] = str(exc)
                # A name that does not exist has no workers behind it (all replicas gone);
                # any other failure may be a DNS hiccup: keep the workers we know.
                if isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_NONAME:
                    self._resolved[endpoint] = []
                continue
            if self._resolve_errors.pop(endpoint, None) is not None:
                log.info("worker endpoint resolves again", endpoint=endpoint)
            if addresses != self._resolved.get(endpoint) and addresses != [endpoint]:
                log.info("worker endpoint resolved", endpoint=endpoint, workers=addresses)
            self._resolved[endpoint] = addresses
        wanted = dict.fromkeys(a for e in self.config.workers for a in self._resolved.get(e, []))
        await self._sync(list(wanted))

    async def _sync(self, wanted: list[str]) -> None:
        for endpoint in wanted:
            member = self.members.get(endpoint)
            if member is None:
                self._serial += 1
                client = WorkerClient(
                    self.config,
                    self.vocab_size,
                    self.vocab_fingerprint,
                    self.metrics,
                    endpoint=endpoint,
                    identity=f"{self.identity}-{self._serial}",
                    context=self._context,
                )
                self.members[endpoint] = Member(client)
                await client.start()
            elif member.retiring:
                member.retiring = False
                log.info("worker address resolves again", worker=endpoint)
        for endpoint, member in self.members.items():
            if endpoint not in wanted and not member.retiring:
                member.retiring = True
                log.info(
                    "worker address no longer resolves; it gets no new requests",
                    worker=endpoint,
                    open_requests=member.client.open_requests,
                )

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(RESOLVE_SECONDS)
            try:
                await self.resolve()
            except Exception:
                log.exception("resolving the worker endpoints failed")

    async def _watch_loop(self) -> None:
        while True:
            try:
                await self.watch()
            except Exception:
                log.exception("watching the workers failed")
            await asyncio.sleep(WATCH_SECONDS)

    async def watch(self) -> None:
        """Log workers entering and leaving rotation, refresh their metrics, close retired ones."""
        for endpoint, member in list(self.members.items()):
            client = member.client
            reason = "its address no longer resolves" if member.retiring else None
            reason = reason or client.unavailable_reason()
            up = reason is None
            if up != member.up:
                member.up = up
                if up:
                    log.info("worker in rotation", worker=endpoint)
                else:
                    # Its cache is gone or going: a restarted worker starts empty.
                    self.affinity.forget_worker(endpoint)
                    log.warning("worker out of rotation", worker=endpoint, reason=reason)
            if member.retiring and client.open_requests == 0:
                del self.members[endpoint]
                await client.close()
                self.affinity.forget_worker(endpoint)
                if self.metrics is not None:
                    self.metrics.forget_worker(endpoint)
                log.info("worker connection closed", worker=endpoint)
                continue
            if self.metrics is not None:
                self.metrics.worker_up.labels(endpoint).set(1 if up else 0)
                self.metrics.worker_requests_in_flight.labels(endpoint).set(client.open_requests)


def _latest_load(client: WorkerClient) -> Heartbeat:
    """The client's latest heartbeat, or an idle one from its ModelInfo before the first."""
    if client.heartbeat is not None:
        return client.heartbeat
    assert client.info is not None
    slots = client.info.slots
    return Heartbeat(0.0, 0.0, ready=True, queue_depth=0, free_slots=slots, running=0)
