"""The waiting queue: which request takes the next free slot. Plain Python, no model.

Two orders, as vLLM names them: `fcfs` (arrival order) and `priority` (lower `priority` first,
then arrival). Requests belong to tenants; when several tenants wait, turns go round-robin
between them, weighted (stride scheduling: each tenant has a pass that grows by 1/weight per
turn, and the lowest pass goes next), and a tenant at its cap of running requests waits. Under
`priority` the best priority waiting is served first, and the round-robin runs among the
tenants waiting at that priority.

A tenant that starts waiting again takes the current virtual time as its pass, so time spent
idle earns no credit: a tenant with 40 queued requests holds up another's single request by
at most one turn.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from ...protocol.messages import DEFAULT_TENANT as DEFAULT_TENANT


class Policy(StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class Queued(Protocol):
    """What the queue needs of a request."""

    priority: int  # lower is served first under the priority policy
    tenant: str
    order: int  # arrival order, set by the queue on first push; kept when pushed again


# The queue hands back the requests it was given, as their own type (the scheduler's Request).
Q = TypeVar("Q", bound=Queued)


@dataclass(slots=True)
class TenantState(Generic[Q]):
    """One tenant's waiting requests (a heap), running count and round-robin pass."""

    name: str
    weight: float
    heap: list[tuple[int, int, Q]] = field(default_factory=list)  # (rank, order, request)
    running: int = 0
    pass_: float = 0.0  # the virtual time of its next turn

    @property
    def head(self) -> Q:
        return self.heap[0][2]


class WaitingQueue(Generic[Q]):
    """Requests waiting for a slot, in the order the policy and the tenants' shares give."""

    def __init__(
        self,
        policy: Policy | str = Policy.FCFS,
        weights: Mapping[str, float] | None = None,
        max_running_per_tenant: int = 0,
    ) -> None:
        self.policy = Policy(policy)
        self.weights = dict(weights or {})
        self.max_running = max_running_per_tenant  # 0: no cap
        self.tenants: dict[str, TenantState[Q]] = {}
        self._vtime = 0.0  # the pass of the latest turn taken
        self._next_order = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Q]:
        """Every waiting request, tenant by tenant (not in serving order)."""
        for tenant in self.tenants.values():
            for _, _, request in tenant.heap:
                yield request

    # --- in and out ---------------------------------------------------------------------

    def push(self, request: Q) -> None:
        """Queue a request: a new one at the end of its priority, a preempted one where it was."""
        if request.order < 0:
            request.order = self._next_order
            self._next_order += 1
        tenant = self._tenant(request.tenant)
        if not tenant.heap:  # waiting again: no credit for the time it did not wait
            tenant.pass_ = max(tenant.pass_, self._vtime)
        heapq.heappush(tenant.heap, (self._rank(request), request.order, request))
        self._len += 1

    def remove(self, request: Q) -> None:
        """Take a request out of the queue (cancelled); ValueError when it is not there."""
        tenant = self.tenants.get(request.tenant)
        if tenant is None:
            raise ValueError("the request is not queued")
        for i, (_, _, queued) in enumerate(tenant.heap):
            if queued is request:
                tenant.heap[i] = tenant.heap[-1]
                tenant.heap.pop()
                heapq.heapify(tenant.heap)
                self._len -= 1
                self._forget_if_idle(tenant)
                return
        raise ValueError("the request is not queued")

    def peek(self) -> Q | None:
        """The request that takes the next free slot; None when every waiting tenant is capped."""
        tenant = self._next_tenant()
        return tenant.head if tenant is not None else None

    def pop(self) -> Q | None:
        """Take the request peek() names and count its tenant's turn."""
        tenant = self._next_tenant()
        if tenant is None:
            return None
        _, _, request = heapq.heappop(tenant.heap)
        self._len -= 1
        self._vtime = max(self._vtime, tenant.pass_)
        tenant.pass_ += 1.0 / tenant.weight
        return request

    # --- running requests, for the caps and the per-tenant counts -----------------------

    def started(self, tenant: str) -> None:
        """A request of this tenant took a slot."""
        self._tenant(tenant).running += 1

    def stopped(self, tenant: str) -> None:
        """A request of this tenant left its slot (finished or preempted)."""
        state = self.tenants[tenant]
        state.running -= 1
        self._forget_if_idle(state)

    def counts(self) -> dict[str, tuple[int, int]]:
        """Each known tenant's (running, waiting)."""
        return {name: (t.running, len(t.heap)) for name, t in self.tenants.items()}

    # --- choosing ---------------------------------------------------------------------

    def _rank(self, request: Queued) -> int:
        return request.priority if self.policy is Policy.PRIORITY else 0

    def _next_tenant(self) -> TenantState[Q] | None:
        best: TenantState[Q] | None = None
        best_key: tuple[int, float, int] | None = None
        for tenant in self.tenants.values():
            if not tenant.heap or (self.max_running and tenant.running >= self.max_running):
                continue
            rank, order, _ = tenant.heap[0]
            key = (rank, tenant.pass_, order)  # best priority, then turn, then arrival
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        return best

    def _tenant(self, name: str) -> TenantState[Q]:
        tenant = self.tenants.get(name)
        if tenant is None:
            weight = self.weights.get(name, 1.0)
            tenant = self.tenants[name] = TenantState(name, weight, pass_=self._vtime)
        return tenant

    def _forget_if_idle(self, tenant: TenantState[Q]) -> None:
        # Tenants come and go (the `user` field names them): keep only those with requests.
        if not tenant.heap and tenant.running <= 0:
            del self.tenants[tenant.name]
