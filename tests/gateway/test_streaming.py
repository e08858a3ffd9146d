"""generate/streaming.py in process: a GenerationGroup's events as server-sent events, ending
with usage and [DONE], or with an error event when the worker fails mid-stream."""

from __future__ import annotations

import asyncio
import json

from loomserve.gateway.api.schemas import CompletionRequest
from loomserve.gateway.generate.group import GenerationGroup
from loomserve.gateway.generate.render import DONE_EVENT, StreamChunks
from loomserve.gateway.generate.streaming import collect, event_stream
from loomserve.gateway.workers.errors import WorkerFailed
from tests.gateway.scripted import Pieces, ScriptedPool, chunk, request, tokens_then_finish

STREAM = CompletionRequest(prompt="Hi", stream=True, stream_options={"include_usage": True})


async def stream(pool: ScriptedPool, body: CompletionRequest) -> list[str]:
    generation = request(body)
    group = await GenerationGroup.start(pool, Pieces(), generation, None)
    return [event async for event in event_stream(group, StreamChunks(generation))]


def test_a_stream_sends_text_the_finish_usage_and_done() -> None:
    pool = ScriptedPool(lambda g: tokens_then_finish(g.request_id, [1, 2]))
    events = asyncio.run(stream(pool, STREAM))
    assert events[-1] == DONE_EVENT
    bodies = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert "".join(b["choices"][0]["text"] for b in bodies if b["choices"]) == "Hello world"
    assert bodies[-2]["choices"][0]["finish_reason"] == "length"
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 2


def test_a_worker_failing_mid_stream_ends_it_with_an_error_event() -> None:
    pool = ScriptedPool(lambda g: [chunk(g.request_id, [1], 0), WorkerFailed("engine failed")])
    events = asyncio.run(stream(pool, STREAM))
    assert DONE_EVENT not in events
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["error"]["message"] and last["error"]["code"]
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "Hello"


def test_a_body_is_collected_whole() -> None:
    pool = ScriptedPool(lambda g: tokens_then_finish(g.request_id, [1, 6, 5]))

    async def scenario():
        generation = request(CompletionRequest(prompt="Hi"))
        group = await GenerationGroup.start(pool, Pieces(), generation, None)
        return await collect(group)

    texts, dones, logprobs, thoughts = asyncio.run(scenario())
    assert texts == ["Hello again!"] and logprobs == [[]] and thoughts == [""]
    assert [d.finish_reason for d in dones] == ["length"]
