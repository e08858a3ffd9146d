"""`loomserve bench --dataset multi-turn`: conversations that send their whole history, each
turn after the one before it. Against the instant server, on loopback, a second at most."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import pytest

from loomserve.cli.bench.client import StreamingClient, build_payload
from loomserve.cli.bench.datasets import approximate_token_counts, multi_turn_dataset
from loomserve.cli.bench.runner import LoadShape, run_load


def dataset(n_conversations: int = 3, n_turns: int = 4):
    return multi_turn_dataset(n_conversations, n_turns, 40, 12, 8, 0.0, 7, approximate_token_counts)


def test_each_turn_carries_its_conversations_whole_history():
    requests = dataset()
    assert (
        len(requests) == 12 and [r.turn for r in requests] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    )
    for i, request in enumerate(requests):
        if request.turn == 0:
            assert request.follows is None and request.history == ()
            continue
        before = requests[request.follows]
        assert request.follows == i - 3 and before.turn == request.turn - 1
        assert request.system_prompt == before.system_prompt
        # The previous turn's history, its user message, then an answer of its length.
        assert request.history[:-2] == before.history
        assert request.history[-2] == ("user", before.prompt)
        role, answer = request.history[-1]
        assert role == "assistant" and answer
        assert request.prompt_len > before.prompt_len
    assert len({r.system_prompt for r in requests}) == 3  # one per conversation


def test_the_chat_body_holds_the_history_in_order():
    request = dataset()[6]  # conversation 0, turn 2
    body = build_payload(request, "m", "chat", ignore_eos=True, temperature=0.0)
    roles = [message["role"] for message in body["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert body["messages"][-1]["content"] == request.prompt
    text = build_payload(request, "m", "completions", ignore_eos=True, temperature=0.0)["prompt"]
    assert text.startswith(request.system_prompt) and text.endswith(request.prompt)


@pytest.fixture
def instant_server() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomserve.cli.bench.instant_server", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on"), line
        yield f"http://127.0.0.1:{line.split()[-1]}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_turn_is_sent_only_after_the_one_before_it_ended(instant_server: str):
    requests = dataset(n_conversations=4, n_turns=3)

    async def main():
        client = StreamingClient(instant_server, "instant", "chat", timeout_s=10.0)
        try:
            return await run_load(
                client, requests, LoadShape(max_concurrency=2), seed=0, progress=False
            )
        finally:
            await client.aclose()

    result = asyncio.run(asyncio.wait_for(main(), 30))
    records = result.records
    assert all(record.success for record in records)
    for request, record in zip(requests, records, strict=True):
        if request.follows is not None:
            before = records[request.follows]
            assert record.start_s >= before.start_s + before.e2e_s
