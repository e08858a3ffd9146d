"""OpenRequests without a socket: what it sends, and where each of the worker's replies goes.

The worker's side is played by the test: it reads what OpenRequests sends and routes the
replies a worker would give, as WorkerClient's receive loop does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest

from loomserve.gateway.config import GatewayConfig
from loomserve.gateway.workers.errors import (
    ReaderTooSlow,
    WorkerLost,
    WorkerRejected,
    WorkerTimeout,
    WorkerUnavailable,
)
from loomserve.gateway.workers.open_requests import OpenRequests
from loomserve.protocol.messages import (
    Accepted,
    Cancel,
    Embed,
    Embeddings,
    Finish,
    Generate,
    Message,
    Outputs,
    Rejected,
    SamplingParams,
    SlotsQuery,
    SlotsReport,
    TokenChunk,
)

CONFIG = GatewayConfig(model_path=Path("m.gguf"), stream_buffer_tokens=4, request_timeout=30.0)


class Wire:
    """What OpenRequests sent; `connected` False plays a worker that is not connected."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.connected = True

    def send(self, message: Message) -> bool:
        if self.connected:
            self.sent.append(message)
        return self.connected


def generate(request_id: str) -> Generate:
    return Generate(request_id, [1, 2], SamplingParams(max_tokens=8))


async def accepted(requests: OpenRequests, wire: Wire, message: Generate | Embed, reply: Message):
    """Submit `message` and answer it with `reply` once it is on the wire."""
    before = len(wire.sent)
    submit = asyncio.create_task(requests.submit(message, None))
    while len(wire.sent) == before and not submit.done():
        await asyncio.sleep(0)
    assert wire.sent[-1] == message
    assert requests.route(reply)
    return await submit


def test_a_generate_gets_its_tokens_and_its_finish_then_is_closed() -> None:
    async def scenario() -> None:
        wire = Wire()
        requests = OpenRequests(CONFIG, "tcp://w:1", wire.send)
        handle = await accepted(requests, wire, generate("a"), Accepted("a", 0))
        assert "a" in requests and requests.pending == 1  # no heartbeat has counted it yet
        requests.heartbeat_came()
        assert requests.pending == 0
        finish = Finish("a", "length", 2, 2, 0, 0.0)
        assert requests.route(Outputs([TokenChunk("a", [5]), TokenChunk("x", [9])], []))
        assert requests.route(Outputs([TokenChunk("a", [6], seq=1)], [finish]))
        assert [event for event in await handle.next_events()] == [
            TokenChunk("a", [5]),
            TokenChunk("a", [6], seq=1),
            finish,
        ]
        assert "a" not in requests and len(requests) == 0 and handle.buffered == 0
        await accepted(requests, wire, generate("a"), Accepted("a", 0))  # its id is free again
        with pytest.raises(ValueError, match="already in use"):  # but not while it is open
            await requests.submit(generate("a"), None)

    asyncio.run(scenario())


def test_a_refusal_a_dead_connection_and_a_silent_worker_leave_nothing_open() -> None:
    async def scenario() -> None:
        wire = Wire()
        requests = OpenRequests(CONFIG, "tcp://w:1", wire.send)
        with pytest.raises(WorkerRejected) as refused:
            await accepted(requests, wire, generate("a"), Rejected("a", "queue_full", "full"))
        assert refused.value.code == "queue_full" and len(requests) == 0

        wire.connected = False
        with pytest.raises(WorkerUnavailable, match="not connected to the worker at tcp://w:1"):
            await requests.submit(generate("b"), None)
        assert len(requests) == 0

        # An Embed waits for its Embeddings until its deadline, then is cancelled and closed.
        wire.connected = True
        embed = Embed("e", [[1, 2]])
        with pytest.raises(WorkerTimeout):
            await requests.submit(embed, time.monotonic() + 0.05)
        assert wire.sent[-1] == Cancel("e") and len(requests) == 0
        answer = Embeddings("f", 1, b"\x00\x00\x80?", 2)
        handle = await accepted(requests, wire, replace(embed, request_id="f"), answer)
        assert handle.accepted.result() is answer and len(requests) == 0

    asyncio.run(scenario())


def test_a_reader_that_falls_behind_is_cancelled_after_its_tokens() -> None:
    async def scenario() -> None:
        wire = Wire()
        requests = OpenRequests(CONFIG, "tcp://w:1", wire.send)
        handle = await accepted(requests, wire, generate("a"), Accepted("a", 0))
        requests.route(Outputs([TokenChunk("a", [1, 2, 3])], []))
        assert "a" in requests  # within stream_buffer_tokens (4)
        requests.route(Outputs([TokenChunk("a", [4, 5], seq=3)], []))
        assert wire.sent[-1] == Cancel("a") and "a" not in requests
        assert [len(e.token_ids) for e in await handle.next_events()] == [3, 2]
        with pytest.raises(ReaderTooSlow, match="5 tokens waited"):
            await handle.next_events()

    asyncio.run(scenario())


def test_a_lost_connection_fails_every_request_and_slot_query() -> None:
    async def scenario() -> None:
        wire = Wire()
        requests = OpenRequests(CONFIG, "tcp://w:1", wire.send)
        handle = await accepted(requests, wire, generate("a"), Accepted("a", 0))
        query = asyncio.create_task(requests.query_slots(5.0))
        while not any(isinstance(m, SlotsQuery) for m in wire.sent):
            await asyncio.sleep(0)
        requests.route(Outputs([TokenChunk("a", [7])], []))
        lost = WorkerLost("the connection to the worker closed")
        requests.fail_all(lost)
        assert len(requests) == 0
        with pytest.raises(WorkerLost):
            await query
        assert [e.token_ids for e in await handle.next_events()] == [[7]]  # tokens first
        with pytest.raises(WorkerLost):
            await handle.next_events()
        # A slot query is answered by its id; an unknown reply is not OpenRequests' business.
        wire.sent.clear()
        query = asyncio.create_task(requests.query_slots(5.0))
        while not wire.sent:
            await asyncio.sleep(0)
        (sent,) = wire.sent
        assert isinstance(sent, SlotsQuery)
        assert requests.route(SlotsReport("another query", 0, [], []))  # dropped: not ours
        report = SlotsReport(sent.query_id, 0, [], [])
        assert requests.route(report) and await query is report
        assert not requests.slot_queries and not requests.route(Cancel("a"))

    asyncio.run(scenario())


def test_a_reader_past_its_deadline_gets_the_tokens_before_it_then_the_timeout() -> None:
    """One timer a request: at the deadline WorkerTimeout follows what came before it, and
    nothing the worker sends after is read; a request that ends in time leaves no timer."""

    async def scenario() -> None:
        wire = Wire()
        requests = OpenRequests(CONFIG, "tcp://w:1", wire.send)
        handle = await accepted(requests, wire, generate("a"), Accepted("a", 0))
        handle.deadline = time.monotonic() + 0.05
        requests.route(Outputs([TokenChunk("a", [1])], []))
        assert await handle.next_events() == [TokenChunk("a", [1])]
        requests.route(Outputs([TokenChunk("a", [2], seq=1)], []))
        assert await handle.next_events() == [TokenChunk("a", [2], seq=1)]
        with pytest.raises(WorkerTimeout):
            await handle.next_events()
        requests.route(
            Outputs([TokenChunk("a", [3], seq=2)], [Finish("a", "cancelled", 2, 3, 0, 0.0)])
        )
        assert handle.events.empty() and "a" not in requests

        on_time = await accepted(requests, wire, generate("b"), Accepted("b", 0))
        requests.route(Outputs([TokenChunk("b", [1])], []))
        assert await on_time.next_events() == [TokenChunk("b", [1])]
        waiting = asyncio.create_task(on_time.next_events())
        await asyncio.sleep(0)
        assert on_time.reading and on_time._deadline_timer is not None
        finish = Finish("b", "length", 2, 1, 0, 0.0)
        requests.route(Outputs([], [finish]))
        assert await waiting == [finish]
        assert on_time.closed and on_time._deadline_timer is None

    asyncio.run(scenario())
