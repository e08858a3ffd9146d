"""generate/group.py in process: n choices per prompt, started after the first's prompt is
cached, interleaved, counted once per prompt in the usage; one failing choice ends the rest."""

from __future__ import annotations

import asyncio

import pytest

from loomserve.gateway.api.schemas import CompletionRequest
from loomserve.gateway.generate.assembly import Done, TextDelta
from loomserve.gateway.generate.group import GenerationGroup
from loomserve.gateway.workers.errors import WorkerFailed
from loomserve.protocol.messages import Generate
from tests.gateway.scripted import Pieces, Script, ScriptedPool, request, tokens_then_finish

WORDS = {"0": [1, 2], "1": [1, 6, 5], "2": [1], "3": [2, 2]}


def answer(generate: Generate) -> Script:
    return tokens_then_finish(generate.request_id, WORDS[generate.request_id.rsplit("-", 1)[1]])


async def collect(group: GenerationGroup) -> dict[int, list[TextDelta | Done]]:
    seen: dict[int, list[TextDelta | Done]] = {}
    async for index, event in group.events():
        seen.setdefault(index, []).append(event)
    return seen


def test_n_choices_per_prompt_each_with_its_text_and_one_usage() -> None:
    pool = ScriptedPool(answer)
    body = CompletionRequest(prompt=["a", "b"], n=2)

    async def scenario() -> tuple[GenerationGroup, dict[int, list[TextDelta | Done]]]:
        group = await GenerationGroup.start(pool, Pieces(), request(body, prompts=2, n=2), None)
        return group, await collect(group)

    group, seen = asyncio.run(scenario())
    texts = {
        i: "".join(e.text for e in events if isinstance(e, TextDelta)) for i, events in seen.items()
    }
    assert texts == {0: "Hello world", 1: "Hello again!", 2: "Hello", 3: " world world"}
    assert all(isinstance(events[-1], Done) for events in seen.values())
    # The first choice of each prompt goes first; its copies once its prompt is cached.
    ids = [g.request_id for g in pool.submitted]
    assert ids[:2] == ["cmpl-t-0", "cmpl-t-2"] and sorted(ids[2:]) == ["cmpl-t-1", "cmpl-t-3"]
    usage = group.usage()
    assert usage.prompt_tokens == 2 * 3  # each prompt once, as OpenAI counts n choices
    assert usage.completion_tokens == 2 + 3 + 1 + 2
    assert usage.prompt_tokens_details.cached_tokens == 2


def test_one_failing_choice_fails_the_request_and_cancels_the_others() -> None:
    def failing(generate: Generate) -> Script:
        if generate.request_id.endswith("-1"):
            return [WorkerFailed("the engine failed")]
        return []  # the others run on and on

    pool = ScriptedPool(failing)
    body = CompletionRequest(prompt=["a", "b"])

    async def scenario() -> None:
        group = await GenerationGroup.start(pool, Pieces(), request(body, prompts=2), None)
        await collect(group)

    with pytest.raises(WorkerFailed):
        asyncio.run(scenario())
    assert pool.client.cancelled == ["cmpl-t-0"]  # the one still running in the worker
    assert pool.client.cancel_reasons == ["cancelled"]  # the gateway gave up on it
