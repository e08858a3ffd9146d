"""WorkerPool: the gateway's connections to every worker, and which one gets each request.

It owns one WorkerClient per worker address, a set that Membership (membership.py) keeps in
step with the configured endpoints; the pool closes an address that no longer resolves once
its open requests end. A worker is in rotation while its client says it can serve (connected,
heartbeating, ready, same vocabulary); the client takes care of saying Hello again, so a worker
that comes back rejoins by itself. The pool watches who is in rotation, for the log and the
metrics, and answers for all its workers: ready, their ModelInfo, their load, their slots.

Each request goes where routing.py's policy says (`pick`); whether it goes on to another
worker when that one fails it is decided by its Tries (retries.py), the one owner of a
request's retries.

Workers may serve different models (the directory, directory.py, says which a worker
serves). `for_model(name)` is the pool seen through one model: it picks, reports and sums
among that model's workers only, so to the code that runs a request it looks like one worker
of that model: ready while any is, the ModelInfo of the ready ones, their load summed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass

import structlog
import zmq.asyncio

from ...protocol.messages import Heartbeat, Load, ModelInfo, SlotsReport
from ..config import GatewayConfig
from ..endpoints import expand, needs_resolving
from ..metrics import GatewayMetrics
from .client import WorkerClient, stop_tasks
from .dealer import gateway_identity
from .directory import ModelDirectory
from .errors import WorkerClientError
from .keepalive import KeepAlive
from .membership import Member, Membership
from .routing import (
    Choice,
    PrefixAffinity,
    WorkerLoad,
    choose_worker,
    preferred_worker,
)

log = structlog.get_logger(__name__)

WATCH_SECONDS = 0.25  # how often rotation changes are logged and the metrics refreshed


@dataclass(frozen=True, slots=True)
class WorkerSlots:
    """One worker's answer to GET /slots, or why there is none."""

    endpoint: str
    model: str | None  # the name its model is served under, once the gateway placed it
    info: ModelInfo | None  # its latest ModelInfo; None while it has not answered Hello
    heartbeat: Heartbeat | None  # its latest load report
    unavailable: str | None  # why it is out of rotation; None while in it
    report: SlotsReport | None  # None when it could not be asked or did not answer
    error: str | None = None  # why there is no report


class WorkerPool:
    """Every worker connection of one gateway; routes each request to one of them."""

    def __init__(
        self,
        config: GatewayConfig,
        directory: ModelDirectory,
        metrics: GatewayMetrics | None = None,
        resolver: Callable[[str], list[str]] = expand,
    ) -> None:
        self.config = config
        self.identity = gateway_identity()  # each worker connection adds a serial number
        self.metrics = metrics
        self._context = zmq.asyncio.Context()  # one IO thread for all worker sockets
        self.membership = Membership(
            config, directory, metrics, resolver, self.identity, self._context
        )
        self.affinity = PrefixAffinity()
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self.keepalive = KeepAlive(config)  # pings from a thread, whatever the loop does

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the endpoints, connect to every worker, start watching them."""
        await self.resolve()
        self.keepalive.start()
        self._tasks = [asyncio.create_task(self._watch_loop(), name="workers-watch")]
        if any(needs_resolving(endpoint) for endpoint in self.config.worker_endpoints):
            resolving = self.membership.resolve_loop()
            self._tasks.append(asyncio.create_task(resolving, name="workers-resolve"))

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
        self._closing = True  # no request goes to a worker being closed
        self.keepalive.close()
        await stop_tasks(self._tasks)
        self._tasks = []
        await self.membership.close()
        self._context.destroy(linger=0)

    # --- state -------------------------------------------------------------------

    @property
    def members(self) -> dict[str, Member]:
        """Every worker connection, by worker address."""
        return self.membership.members

    async def resolve(self) -> None:
        """Look the endpoints up again and connect to new addresses, retire vanished ones."""
        await self.membership.resolve()

    def for_model(self, model: str) -> ModelWorkers:
        """The pool as one model's requests see it: its workers only."""
        return ModelWorkers(self, model)

    def for_any(self) -> ModelWorkers:
        """The pool as the one-model gateway's requests see it: every worker."""
        return ModelWorkers(self, None)

    def in_rotation(self, model: str | None = None) -> list[WorkerClient]:
        """The clients of the workers (of `model`) that can take requests now."""
        return [
            member.client
            for _, member in self.membership.serving(model)
            if member.client.unavailable_reason() is None
        ]

    def counts(self, model: str | None = None) -> tuple[int, int]:
        """(workers in rotation, workers known), of `model` or of all."""
        return len(self.in_rotation(model)), len(self.membership.serving(model))

    def models(self) -> dict[str, int]:
        """Every model some known worker serves, with how many of its workers are in rotation."""
        served: dict[str, int] = {}
        for _, member in self.membership.serving(None):
            if member.client.model is not None:
                up = member.client.unavailable_reason() is None
                served[member.client.model] = served.get(member.client.model, 0) + up
        return served

    def busy_models(self) -> list[str]:
        """The models with requests of this gateway open on their workers (sent, not ended)."""
        return sorted(
            {
                member.client.model
                for member in self.members.values()  # retiring ones too: they still run them
                if member.client.model is not None and member.client.open_requests
            }
        )

    def unavailable_reason(self, model: str | None = None) -> str | None:
        """Why no request (for `model`) can be served now; None while a worker can take one."""
        reasons: dict[str, str] = {}
        for endpoint, member in self.membership.serving(model):
            reason = member.client.unavailable_reason()
            if reason is None:
                return None
            reasons[endpoint] = reason
        if not reasons:
            if model is not None and self.membership.serving(None):
                return f"no worker serves the model {model!r} now"
            return self.membership.none_known()
        if len(reasons) == 1:
            return next(iter(reasons.values()))
        listed = "; ".join(f"{endpoint}: {reason}" for endpoint, reason in reasons.items())
        return f"none of the {len(reasons)} workers can take requests ({listed})"

    def info_of(self, model: str | None = None) -> ModelInfo | None:
        """A ready worker's ModelInfo: the one with the smallest slot context, to be safe."""
        infos = [client.info for client in self.in_rotation(model) if client.info is not None]
        return min(infos, key=lambda info: info.slot_context) if infos else None

    @property
    def info(self) -> ModelInfo | None:
        return self.info_of(None)

    def load_of(self, model: str | None = None) -> Load | None:
        """The ready workers' latest loads (of `model`), summed; None while none is ready.

        A worker that answered Hello but has not heartbeated yet counts as idle, as in routing.
        """
        loads = [_latest_load(client) for client in self.in_rotation(model) if client.info]
        if not loads:
            return None
        return Load(
            queue_depth=sum(load.queue_depth for load in loads),
            free_slots=sum(load.free_slots for load in loads),
            running=sum(load.running for load in loads),
        )

    @property
    def load(self) -> Load | None:
        return self.load_of(None)

    async def slots(self, timeout: float) -> list[WorkerSlots]:
        """Every known worker's slots, asked of all at once; each answers or says why not."""
        members = [(e, m.client) for e, m in self.members.items() if not m.retiring]
        reports = await asyncio.gather(*(self._slots_of(client, timeout) for _, client in members))
        return [
            WorkerSlots(
                endpoint,
                client.model,
                client.info,
                client.heartbeat,
                client.unavailable_reason(),
                report,
                error,
            )
            for (endpoint, client), (report, error) in zip(members, reports, strict=True)
        ]

    @staticmethod
    async def _slots_of(
        client: WorkerClient, timeout: float
    ) -> tuple[SlotsReport | None, str | None]:
        try:
            return await client.slots(timeout), None
        except WorkerClientError as exc:
            return None, exc.message

    # --- requests ------------------------------------------------------------------

    def in_use(self, request_id: str) -> bool:
        """Whether a request with this id is open on any worker (ids are unique per gateway)."""
        return any(member.client.in_use(request_id) for member in self.members.values())

    def pick(
        self,
        key: int | None,
        exclude: Collection[str] = (),
        keys: list[int] | None = None,
        model: str | None = None,
    ) -> tuple[WorkerClient, Choice] | None:
        """The worker routing.py's policy gives a prompt with this affinity key, among those
        (of `model`) in rotation and not in `exclude`; None when none is left (or the pool is
        closing). Prefix affinity works among one model's workers: only they cache its prompts.

        Which workers a request may still go to is its Tries' business (retries.py).
        """
        if self._closing:
            return None
        loads = []
        advertised: dict[str, list[int]] = {}
        for endpoint, member in self.members.items():
            client = member.client
            if endpoint in exclude or member.retiring or client.info is None:
                continue
            if model is not None and client.model != model:
                continue
            if client.unavailable_reason() is not None:
                continue
            loads.append(
                WorkerLoad(
                    endpoint,
                    client.info.slots,
                    _latest_load(client),
                    client.pending_requests,
                    client.open_requests,
                )
            )
            if keys and client.heartbeat is not None:
                advertised[endpoint] = list(client.heartbeat.prefixes)
        if not loads:
            return None
        random.shuffle(loads)  # ties go to a random worker, not always the first listed
        preferred = preferred_worker(self.affinity.owner(key), keys or [], advertised)
        choice = choose_worker(loads, preferred)
        return self.members[choice.endpoint].client, choice

    def routed(self, choice: Choice, key: int | None, client: WorkerClient) -> None:
        """A worker took a generation request: remember its prefix there, count it."""
        self.affinity.record(key, choice.endpoint)
        if self.metrics is not None:
            self.metrics.worker_requests_routed.labels(choice.endpoint).inc()
            self.metrics.worker_requests_in_flight.labels(choice.endpoint).set(client.open_requests)
            if choice.affinity:
                self.metrics.worker_prefix_affinity_hits.labels(choice.endpoint).inc()

    def count_reroute(self, reason: str) -> None:
        """A request goes to another worker: its first was `lost`, or `refused` it."""
        if self.metrics is not None:
            self.metrics.requests_rerouted.labels(reason).inc()

    # --- watching the workers ---------------------------------------------------------

    async def _watch_loop(self) -> None:
        while True:
            try:
                await self.watch()
            except Exception:
                log.exception("watching the workers failed")
            await asyncio.sleep(WATCH_SECONDS)

    def note_rotation(self) -> None:
        """Log workers entering and leaving rotation. The watch does it every WATCH_SECONDS;
        /health too, before it answers, so a 200 never precedes its `worker in rotation`."""
        for endpoint, member in self.members.items():
            reason = "its address no longer resolves" if member.retiring else None
            reason = reason or member.client.unavailable_reason()
            up = reason is None
            if up != member.up:
                member.up = up
                if up:
                    log.info("worker in rotation", worker=endpoint)
                else:
                    # Its cache is gone or going: a restarted worker starts empty.
                    self.affinity.forget_worker(endpoint)
                    log.warning("worker out of rotation", worker=endpoint, reason=reason)

    async def watch(self) -> None:
        """Log workers entering and leaving rotation, refresh their metrics, close retired ones,
        tell the keep-alive thread which connections to keep alive."""
        self.note_rotation()
        self.keepalive.watch(
            {
                endpoint: member.client.identity
                for endpoint, member in self.members.items()
                if member.client.info is not None  # said Hello: the worker knows it
            }
        )
        for endpoint in await self.membership.close_retired():
            self.affinity.forget_worker(endpoint)
            if self.metrics is not None:
                self.metrics.forget_worker(endpoint)
        if self.metrics is not None:
            for endpoint, member in self.members.items():
                self.metrics.worker_up.labels(endpoint).set(1 if member.up else 0)
                open_requests = member.client.open_requests
                self.metrics.worker_requests_in_flight.labels(endpoint).set(open_requests)
                _export_load(self.metrics, endpoint, member.client.heartbeat)


def _export_load(metrics: GatewayMetrics, endpoint: str, beat: Heartbeat | None) -> None:
    """The worker's load gauges from its latest heartbeat; zeros without one (it is down,
    or has not spoken yet: nothing runs there, nothing can start, its cache is gone)."""
    if beat is None:
        metrics.set_worker_load(endpoint, 0, 0, 0, 0.0)
        return
    usage = beat.kv_cells_used / beat.kv_cells_total if beat.kv_cells_total else 0.0
    load = beat.load
    metrics.set_worker_load(endpoint, load.running, load.queue_depth, load.free_slots, usage)


def _latest_load(client: WorkerClient) -> Load:
    """The load of the client's latest heartbeat, or idle from its ModelInfo before the first."""
    if client.heartbeat is not None:
        return client.heartbeat.load
    assert client.info is not None
    return Load(queue_depth=0, free_slots=client.info.slots, running=0)


@dataclass(frozen=True, slots=True)
class ModelWorkers:
    """The pool through one model: what runs a request of that model sees of the workers."""

    pool: WorkerPool
    model: str | None  # None: every worker's (one model, whatever the workers call it)

    @property
    def config(self) -> GatewayConfig:
        return self.pool.config

    @property
    def info(self) -> ModelInfo | None:
        return self.pool.info_of(self.model)

    @property
    def load(self) -> Load | None:
        return self.pool.load_of(self.model)

    def unavailable_reason(self) -> str | None:
        return self.pool.unavailable_reason(self.model)

    def pick(
        self, key: int | None, exclude: Collection[str] = (), keys: list[int] | None = None
    ) -> tuple[WorkerClient, Choice] | None:
        return self.pool.pick(key, exclude, keys, model=self.model)

    def routed(self, choice: Choice, key: int | None, client: WorkerClient) -> None:
        self.pool.routed(choice, key, client)

    def count_reroute(self, reason: str) -> None:
        self.pool.count_reroute(reason)

    def in_use(self, request_id: str) -> bool:
        return self.pool.in_use(request_id)
