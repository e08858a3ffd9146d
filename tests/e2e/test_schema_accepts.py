"""/openapi.json says what the server accepts (issue 60, item 23): each body schemathesis found
refused with a 400 although the document allowed it is now outside the document, its
neighbours the document allows are answered 200, and the streamed answers' events match the
documented text/event-stream schema (one event: `data`, and `event` where named).

Real worker and gateway processes on the tiny model (tests/procs.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator

from tests.procs import Proc, start_gateway, start_worker

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tiny_model_path: Path) -> Iterator[tuple[Proc, dict[str, Any], str]]:
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=256) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        document = httpx.get(gateway.url + "/openapi.json").json()
        model = httpx.get(gateway.url + "/v1/models").json()["data"][0]["id"]
        yield gateway, document, model


def validator(document: dict[str, Any], path: str, status: str | None = None) -> Any:
    """A validator of a route's request body (status None) or of one 200 event stream event;
    the document's components go along, for its $refs."""
    post = document["paths"][path]["post"]
    if status is None:
        schema = post["requestBody"]["content"]["application/json"]["schema"]
    else:
        schema = post["responses"][status]["content"]["text/event-stream"]["schema"]
    return Draft202012Validator({**schema, "components": document["components"]})


def refused(model: str) -> list[tuple[str, dict[str, Any]]]:
    """The audit's bodies: each a 400 from the server."""
    return [
        ("/detokenize", {"tokens": [0, 544]}),  # the tiny vocabulary has 544 tokens
        ("/v1/completions", {"prompt": [1, 544], "max_tokens": 2}),
        ("/v1/embeddings", {"input": [[1, 544]]}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "top_logprobs": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "best_of": 0}),
        ("/v1/embeddings", {"input": ""}),
        ("/v1/messages", {"model": model, "max_tokens": 2, "messages": HI, "top_p": 0}),
        ("/v1/messages/count_tokens", {"model": model, "messages": HI, "thinking": {}}),
        ("/v1/responses", {"model": model, "input": "hi", "background": True}),
        ("/v1/responses/input_tokens", {"model": model, "input": "hi", "conversation": {}}),
        ("/models/load", {"model": ""}),
        ("/models/unload", {"model": ""}),
    ]


def accepted(model: str) -> list[tuple[str, dict[str, Any]]]:
    """Their neighbours that the server takes: the document must allow them too."""
    return [
        ("/detokenize", {"tokens": [0, 543]}),
        ("/v1/completions", {"prompt": [[1, 543]], "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 2},
        ),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "top_logprobs": None}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "best_of": 1}),
        ("/v1/messages", {"model": model, "max_tokens": 2, "messages": HI, "top_p": 0.5}),
        (
            "/v1/messages/count_tokens",
            {"model": model, "messages": HI, "thinking": {"type": "disabled"}},
        ),
        (
            "/v1/messages/count_tokens",
            {
                "model": model,
                "messages": HI,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
        ),
        (
            "/v1/responses",
            {"model": model, "input": "hi", "max_output_tokens": 2, "background": False},
        ),
        ("/v1/responses/input_tokens", {"model": model, "input": "hi", "conversation": None}),
    ]


def test_each_refused_body_is_outside_the_document(served: tuple[Proc, dict, str]) -> None:
    gateway, document, model = served
    for path, body in refused(model):
        answer = httpx.post(gateway.url + path, json=body, timeout=30)
        assert answer.status_code == 400, (path, body, answer.status_code, answer.text[:200])
        errors = list(validator(document, path).iter_errors(body))
        assert errors, f"{path}: the document allows {body}, which the server refuses"


def test_their_accepted_neighbours_are_inside_it(served: tuple[Proc, dict, str]) -> None:
    gateway, document, model = served
    for path, body in accepted(model):
        errors = [error.message for error in validator(document, path).iter_errors(body)]
        assert not errors, (path, body, errors)
        answer = httpx.post(gateway.url + path, json=body, timeout=30)
        assert answer.status_code == 200, (path, body, answer.text[:200])


def events(text: str) -> list[dict[str, Any]]:
    """Server-sent events as schemathesis reads them: one object per blank-line-ended block."""
    parsed = []
    for block in text.split("\n\n"):
        event: dict[str, Any] = {}
        for line in block.splitlines():
            field, _, value = line.partition(": ")
            event[field] = event[field] + "\n" + value if field in event else value
        if event:
            parsed.append(event)
    return parsed


def test_streamed_answers_match_the_documented_events(served: tuple[Proc, dict, str]) -> None:
    gateway, document, model = served
    streams = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 3}),
        ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 3}),
        ("/v1/messages", {"model": model, "max_tokens": 3, "messages": HI}),
    ]
    for path, body in streams:
        check = validator(document, path, "200")
        answer = httpx.post(gateway.url + path, json={**body, "stream": True}, timeout=30)
        assert answer.headers["content-type"].startswith("text/event-stream"), path
        parsed = events(answer.text)
        assert parsed, path
        for event in parsed:
            errors = [error.message for error in check.iter_errors(event)]
            assert not errors, (path, event, errors)
        json.loads(parsed[0]["data"])  # a JSON chunk first
