"""Tries (gateway/retries.py), the one owner of a request's retries, over a stand-in pool.

Pure logic: which failures send a request on to another worker, the budget of two workers,
and that a resend after a loss raises the loss itself when no worker takes it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from loomserve.gateway.workers.errors import (
    WorkerClientError,
    WorkerFailed,
    WorkerLost,
    WorkerRejected,
    WorkerUnavailable,
)
from loomserve.gateway.workers.retries import MAX_WORKERS_PER_REQUEST, Tries
from loomserve.gateway.workers.routing import Choice
from loomserve.protocol.messages import ErrorCode, Generate, SamplingParams


@dataclass
class StandInClient:
    """A worker connection whose submit answers with a scripted outcome."""

    endpoint: str
    outcome: WorkerClientError | None = None
    submitted: int = 0

    async def submit(self, generate: Generate, deadline: float) -> str:
        self.submitted += 1
        if self.outcome is not None:
            raise self.outcome
        return f"handle@{self.endpoint}"


@dataclass
class StandInPool:
    """Picks the first worker not excluded, in order; records what Tries tells it."""

    clients: list[StandInClient]
    reroutes: list[str] = field(default_factory=list)
    routed_to: list[str] = field(default_factory=list)

    def pick(
        self, key: int | None, exclude: list[str], keys: list[int] | None = None
    ) -> tuple[StandInClient, Choice] | None:
        for client in self.clients:
            if client.endpoint not in exclude:
                return client, Choice(client.endpoint, affinity=False)
        return None

    def count_reroute(self, reason: str) -> None:
        self.reroutes.append(reason)

    def routed(self, choice: Choice, key: int | None, client: StandInClient) -> None:
        self.routed_to.append(choice.endpoint)

    def unavailable_reason(self) -> str | None:
        return None


def generate() -> Generate:
    return Generate("r1", [1, 2, 3], SamplingParams(max_tokens=4))


def submit(pool: StandInPool, tries: Tries | None = None) -> tuple[Tries, object]:
    tries = tries or Tries(pool)  # type: ignore[arg-type]
    result = asyncio.run(tries.submit(generate(), deadline=0.0))
    return tries, result


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (WorkerUnavailable("down"), "refused"),
        (WorkerLost("gone"), "lost"),
        (WorkerRejected(ErrorCode.QUEUE_FULL, "full"), "refused"),
        (WorkerRejected(ErrorCode.NOT_READY, "loading"), "refused"),
    ],
)
def test_a_worker_that_could_not_take_it_sends_it_to_the_next(
    failure: WorkerClientError, reason: str
) -> None:
    pool = StandInPool([StandInClient("a", failure), StandInClient("b")])
    tries, (_, handle) = submit(pool)
    assert handle == "handle@b" and tries.workers == ["a", "b"]
    assert pool.reroutes == [reason] and pool.routed_to == ["b"]


@pytest.mark.parametrize(
    "failure",
    [WorkerRejected(ErrorCode.PROMPT_TOO_LONG, "long"), WorkerFailed("engine")],
)
def test_a_refusal_every_worker_would_repeat_is_final(failure: WorkerClientError) -> None:
    pool = StandInPool([StandInClient("a", failure), StandInClient("b")])
    with pytest.raises(type(failure)):
        submit(pool)
    assert pool.clients[1].submitted == 0 and pool.reroutes == []


def test_the_budget_is_two_workers_and_the_last_error_is_raised() -> None:
    assert MAX_WORKERS_PER_REQUEST == 2
    third = StandInClient("c")
    pool = StandInPool(
        [
            StandInClient("a", WorkerUnavailable("a down")),
            StandInClient("b", WorkerLost("b")),
            third,
        ]
    )
    with pytest.raises(WorkerLost):
        submit(pool)
    assert third.submitted == 0


def test_a_resend_after_a_loss_spends_the_same_budget() -> None:
    first, second = StandInClient("a"), StandInClient("b")
    pool = StandInPool([first, second])
    tries, _ = submit(pool)
    assert tries.workers == ["a"]
    lost = WorkerLost("a died before the first token")
    _, handle = asyncio.run(tries.resend(generate(), 0.0, lost))
    assert handle == "handle@b" and pool.reroutes == ["lost"]
    # Lost again: no budget left, and the client hears of the loss, not of the budget.
    with pytest.raises(WorkerLost) as raised:
        asyncio.run(tries.resend(generate(), 0.0, WorkerLost("b died too")))
    assert raised.value.message == "b died too"


def test_a_resend_with_no_other_worker_raises_the_loss() -> None:
    pool = StandInPool([StandInClient("a")])
    tries, _ = submit(pool)
    lost = WorkerLost("a died")
    with pytest.raises(WorkerLost) as raised:
        asyncio.run(tries.resend(generate(), 0.0, lost))
    assert raised.value is lost
