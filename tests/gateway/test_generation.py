"""generate/generation.py in process: one choice's worker messages become text deltas and a
Done; a stop string cancels the sequence in the worker; a lost worker before the first token
means the sequence is sent again."""

from __future__ import annotations

import asyncio

import pytest

from loomserve.gateway.api.schemas import CompletionRequest
from loomserve.gateway.generate.assembly import Done, TextDelta
from loomserve.gateway.generate.generation import Generation
from loomserve.gateway.workers.errors import WorkerLost
from loomserve.protocol.messages import Generate
from tests.gateway.scripted import (
    Pieces,
    Script,
    ScriptedPool,
    chunk,
    finish,
    request,
    tokens_then_finish,
)


async def run(pool: ScriptedPool, stops: tuple[str, ...] = ()) -> list[TextDelta | Done]:
    generation = await Generation.start(
        pool, Pieces(), request(CompletionRequest(prompt="Hi"), stops=stops), 0, None
    )
    return [event async for event in generation.events()]


def test_tokens_become_text_deltas_then_one_done_with_the_workers_usage() -> None:
    pool = ScriptedPool(lambda g: tokens_then_finish(g.request_id, [1, 2, 5]))
    events = asyncio.run(run(pool))
    # The chunks that arrived together are read as one backlog: one delta.
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Hello world!"]
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (3, 3)
    assert done.usage.prompt_tokens_details.cached_tokens == 1
    assert [g.request_id for g in pool.submitted] == ["cmpl-t"]
    assert pool.client.cancelled == []  # it finished by itself


def test_a_stop_string_across_tokens_cancels_the_sequence_in_the_worker() -> None:
    # " ST" + "OP" spell the stop string; the worker has not finished, so it is cancelled.
    pool = ScriptedPool(lambda g: [chunk(g.request_id, [1], 0), chunk(g.request_id, [3, 4, 2], 1)])
    pool.client.running.add("cmpl-t")

    async def scenario() -> list[TextDelta | Done]:
        generation = await Generation.start(
            pool, Pieces(), request(CompletionRequest(prompt="Hi"), stops=("STOP",)), 0, None
        )
        reader = asyncio.ensure_future(_collect(generation))
        await asyncio.sleep(0.05)
        # The worker answers the cancel with its Finish, as a real worker does.
        generation.handle.events.put_nowait(finish("cmpl-t", 4, reason="cancelled"))
        return await reader

    events = asyncio.run(scenario())
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hello "
    assert isinstance(events[-1], Done) and events[-1].finish_reason == "stop"
    assert pool.client.cancelled == ["cmpl-t"]
    # The worker is told why, and counts it as the client is told: stop, not cancelled.
    assert pool.client.cancel_reasons == ["stop"]


async def _collect(generation: Generation) -> list[TextDelta | Done]:
    return [event async for event in generation.events()]


def test_a_worker_lost_before_the_first_token_is_replaced_once() -> None:
    answers: list[Script] = [[WorkerLost("gone")], tokens_then_finish("cmpl-t", [1, 6])]

    def answer(generate: Generate) -> Script:
        return answers.pop(0)

    pool = ScriptedPool(answer)
    events = asyncio.run(run(pool))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hello again"
    assert len(pool.submitted) == 2  # the same sequence, sent again
    assert pool.reroutes == ["lost"]


def test_a_worker_lost_after_tokens_were_handed_out_fails_the_choice() -> None:
    pool = ScriptedPool(lambda g: [chunk(g.request_id, [1], 0), WorkerLost("gone")])
    with pytest.raises(WorkerLost):
        asyncio.run(run(pool))
    assert len(pool.submitted) == 1  # never sent twice: the client saw part of it
