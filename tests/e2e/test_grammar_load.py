"""The grammar cases of the fifth audit, on real processes and the tiny model (issue 56).

With llama.cpp's grammar sampler, seven `wide60` grammars at once stopped every other stream
of the worker for half a minute, and 128 tools of 800 optional properties each kept the
gateway busy for minutes while every structured request behind them waited. On llguidance
both are ordinary: the grammars run in bounded steps beside a stream, and the oversized
tools are a 400 naming the limit while a small structured request beside them answers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loomserve.protocol.limits import MAX_GUIDANCE_GRAMMAR_BYTES
from tests.procs import Proc, start_gateway, start_worker

# 60 alternatives of `[a-z ]* "q<i>z"`: 2.4 KB that the audit's worker spent seconds a token on.
WIDE60 = "root ::= " + " | ".join(f'[a-z ]* "q{i}z"' for i in range(60))


@pytest.fixture(scope="module")
def served(tiny_model_path: Path) -> Iterator[tuple[Proc, Proc]]:
    with (
        start_worker(tiny_model_path, slots=8, ctx_size=512) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        yield worker, gateway


class Canary:
    """A plain stream read on a thread: how many tokens came, and how it ended."""

    def __init__(self, gateway: Proc) -> None:
        body = {"prompt": "once", "max_tokens": 200, "ignore_eos": True, "stream": True}
        self.body, self.url = body, gateway.url + "/v1/completions"
        self.events: list[str] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=300) as response:
            self.events = [line for line in response.iter_lines() if line.startswith("data: ")]

    def finished(self) -> str:
        self.thread.join(300)
        assert not self.thread.is_alive(), "the canary stream froze"
        assert self.events[-1] == "data: [DONE]"
        return json.loads(self.events[-2][len("data: ") :])["choices"][0]["finish_reason"]


def test_seven_wide_grammars_run_beside_a_stream(served: tuple[Proc, Proc]) -> None:
    worker, gateway = served
    canary = Canary(gateway)
    body = {"prompt": "Say:", "max_tokens": 48, "temperature": 0, "grammar": WIDE60}

    def ask(_: int) -> httpx.Response:
        return httpx.post(gateway.url + "/v1/completions", json=body, timeout=300)

    with ThreadPoolExecutor(max_workers=7) as pool:
        answers = list(pool.map(ask, range(7)))
    for answer in answers:
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        # Either the grammar ended (its text ends in one of the 60 endings) or max_tokens.
        if choice["finish_reason"] == "stop":
            assert any(choice["text"].endswith(f"q{i}z") for i in range(60)), choice["text"]
    assert canary.finished() == "length"
    assert worker.alive()
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200


def test_tools_too_large_to_compile_are_a_400_and_a_small_request_beside_them_answers(
    served: tuple[Proc, Proc],
) -> None:
    _, gateway = served
    properties = {f"p{j}": {"type": "string"} for j in range(800)}
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool{i}",
                "parameters": {"type": "object", "properties": properties},
            },
        }
        for i in range(128)
    ]
    huge = {
        "messages": [{"role": "user", "content": "call one"}],
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 16,
    }
    small = {
        "messages": [{"role": "user", "content": "json please"}],
        "response_format": {"type": "json_object"},
        "max_tokens": 24,
        "temperature": 0,
    }
    url = gateway.url + "/v1/chat/completions"
    with ThreadPoolExecutor(max_workers=6) as pool:
        refused = [pool.submit(httpx.post, url, json=huge, timeout=120) for _ in range(5)]
        beside = pool.submit(httpx.post, url, json=small, timeout=120)
        for future in refused:
            answer = future.result()
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == "tools" and str(MAX_GUIDANCE_GRAMMAR_BYTES) in error["message"]
        answer = beside.result()
    assert answer.status_code == 200, answer.text
    if answer.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(answer.json()["choices"][0]["message"]["content"]), dict)
