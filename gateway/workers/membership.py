"""Membership: the pool's worker connections, kept in step with the configured endpoints.

Host names are looked up again every RESOLVE_SECONDS (in a thread, off the event loop): a new
address gets a WorkerClient, and an address that no longer resolves is retiring: it takes no
new requests, and is closed once its open requests end (WorkerPool's watch asks for that). An
address that resolves again before then takes requests again.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import zmq.asyncio

from ..config import GatewayConfig
from ..metrics import GatewayMetrics
from .client import WorkerClient
from .directory import ModelDirectory

log = structlog.get_logger(__name__)

RESOLVE_SECONDS = 5.0  # how often host names are looked up again


@dataclass(slots=True)
class Member:
    """One worker address and the gateway's connection to it."""

    client: WorkerClient
    up: bool = False  # in rotation at the latest watch (for logs and metrics)
    retiring: bool = False  # its address no longer resolves: no new requests, closed when idle


class Membership:
    """The worker addresses the endpoints resolve to, each with its connection."""

    def __init__(
        self,
        config: GatewayConfig,
        directory: ModelDirectory,
        metrics: GatewayMetrics | None,
        resolver: Callable[[str], list[str]],
        identity: str,
        context: zmq.asyncio.Context,
    ) -> None:
        self.config = config
        self.directory = directory
        self.metrics = metrics
        self.members: dict[str, Member] = {}  # by worker address
        self.identity = identity  # each worker connection adds a serial number
        self._resolver = resolver
        self._context = context  # one IO thread for all worker sockets
        self._resolved: dict[str, list[str]] = {}  # configured endpoint -> its addresses
        self.resolve_errors: dict[str, str] = {}  # configured endpoint -> why it did not resolve
        self._serial = 0

    def serving(self, model: str | None) -> list[tuple[str, Member]]:
        """The members not retiring, of one model's workers (None: of any)."""
        return [
            (endpoint, member)
            for endpoint, member in self.members.items()
            if not member.retiring and (model is None or member.client.model == model)
        ]

    def none_known(self) -> str:
        """Why there is no worker at all: the endpoints that do not resolve, if any."""
        errors = "; ".join(f"{e}: {why}" for e, why in self.resolve_errors.items())
        return f"no worker address resolves ({errors})" if errors else "no worker is known"

    async def close_retired(self) -> list[str]:
        """Close the retiring connections that have no open request left; their addresses."""
        closed = []
        for endpoint, member in list(self.members.items()):
            if member.retiring and member.client.open_requests == 0:
                del self.members[endpoint]
                await member.client.close()
                log.info("worker connection closed", worker=endpoint)
                closed.append(endpoint)
        return closed

    async def close(self) -> None:
        """Close every connection (their open requests end)."""
        for member in self.members.values():
            await member.client.close()
        self.members.clear()

    async def resolve(self) -> None:
        """Look the endpoints up again and connect to new addresses, retire vanished ones."""
        for endpoint in self.config.worker_endpoints:
            try:
                addresses = await asyncio.to_thread(self._resolver, endpoint)
            except OSError as exc:
                if endpoint not in self.resolve_errors:
                    log.warning(
                        "worker endpoint does not resolve", endpoint=endpoint, error=str(exc)
                    )
                self.resolve_errors[endpoint] = str(exc)
                # A name that does not exist has no workers behind it (all replicas gone);
                # any other failure may be a DNS hiccup: keep the workers we know.
                if isinstance(exc, socket.gaierror) and exc.errno == socket.EAI_NONAME:
                    self._resolved[endpoint] = []
                continue
            if self.resolve_errors.pop(endpoint, None) is not None:
                log.info("worker endpoint resolves again", endpoint=endpoint)
            if addresses != self._resolved.get(endpoint) and addresses != [endpoint]:
                log.info("worker endpoint resolved", endpoint=endpoint, workers=addresses)
            self._resolved[endpoint] = addresses
        wanted = dict.fromkeys(
            a for e in self.config.worker_endpoints for a in self._resolved.get(e, [])
        )
        await self._sync(list(wanted))

    async def resolve_loop(self) -> None:
        """Resolve again every RESOLVE_SECONDS, for ever."""
        while True:
            await asyncio.sleep(RESOLVE_SECONDS)
            try:
                await self.resolve()
            except Exception:
                log.exception("resolving the worker endpoints failed")

    async def _sync(self, wanted: list[str]) -> None:
        for endpoint in wanted:
            member = self.members.get(endpoint)
            if member is None:
                self._serial += 1
                client = WorkerClient(
                    self.config,
                    self.directory,
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
