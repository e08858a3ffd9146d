"""What clients that are not OpenAI's own SDK with its defaults expect, against a real worker on
the tiny model: the API's paths without /v1 (a bare base URL), `system_fingerprint`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import Proc, start_gateway, start_worker

MODEL = "tiny-llama"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=512) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as proc,
    ):
        yield proc


def bare_client(gateway: Proc) -> openai.OpenAI:
    """A client given the server's bare address, as llama-server's users write it."""
    return openai.OpenAI(base_url=gateway.url, api_key="unused", max_retries=0)


# --- the API without /v1 ----------------------------------------------------------------


def test_bare_paths_serve_the_openai_api(gateway: Proc) -> None:
    client = bare_client(gateway)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    completion = client.completions.create(model=MODEL, prompt="once", max_tokens=3)
    assert completion.usage is not None and completion.usage.completion_tokens == 3
    chat = client.chat.completions.create(**CHAT, temperature=0)
    pieces = client.chat.completions.create(**CHAT, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert streamed == chat.choices[0].message.content


def test_bare_paths_answer_as_their_v1_routes(gateway: Proc) -> None:
    """Embeddings, Responses and Messages too: each bare path gets its /v1 route's answer."""
    bodies = {
        "/embeddings": {"model": MODEL, "input": "hello"},
        "/responses/input_tokens": {"model": MODEL, "input": "hello"},
        "/messages/count_tokens": {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
        },
    }
    for path, body in bodies.items():
        bare = httpx.post(gateway.url + path, json=body, timeout=30)
        v1 = httpx.post(gateway.url + "/v1" + path, json=body, timeout=30)
        assert (bare.status_code, bare.json()) == (v1.status_code, v1.json()), path
    messages = httpx.post(gateway.url + "/messages", json={"model": "nope"}, timeout=30)
    assert messages.json()["type"] == "error"  # Anthropic's error shape, as under /v1/messages


def test_bare_paths_leave_the_other_routes_and_the_schema_alone(gateway: Proc) -> None:
    # The model manager's routes stay theirs: GET is not one of their methods.
    assert httpx.get(gateway.url + "/models/load").status_code == 405
    assert httpx.get(gateway.url + "/chat/completions/extra").status_code == 404
    paths = httpx.get(gateway.url + "/openapi.json").json()["paths"]
    assert "/v1/chat/completions" in paths and "/chat/completions" not in paths


# --- system_fingerprint -----------------------------------------------------------------


def test_chat_completions_carry_a_stable_system_fingerprint(gateway: Proc) -> None:
    client = bare_client(gateway)
    first = client.chat.completions.create(**CHAT)
    again = client.chat.completions.create(**CHAT)
    fingerprint = first.system_fingerprint
    assert fingerprint is not None and fingerprint.startswith("fp_")
    assert again.system_fingerprint == fingerprint
    chunks = list(client.chat.completions.create(**CHAT, stream=True))
    assert chunks and {c.system_fingerprint for c in chunks} == {fingerprint}
