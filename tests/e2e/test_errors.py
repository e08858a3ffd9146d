"""Every error a gateway answers, in OpenAI's shape, against real worker processes."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import LONG_CTX
from tests.procs import Proc, free_port, start_gateway, start_worker, wait_http
from tests.tiny_model import ModelShape, write_tiny_model

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 256 * 1024
CTX = LONG_CTX


@pytest.fixture(scope="module")
def gateway(long_model_path: Path) -> Iterator[Proc]:
    """One slot, one queue place; the gateway wants an API key and takes 256 KiB bodies."""
    with (
        start_worker(long_model_path, slots=1, max_queue=1, ctx_size=CTX) as worker,
        start_gateway(
            long_model_path, worker.endpoint, api_key=[KEY], max_body_bytes=MAX_BODY
        ) as proc,
    ):
        yield proc


def post(gateway: Proc, path: str, body: object, **kwargs: object) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, headers=AUTH, timeout=10, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_api_key(gateway: Proc) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    error = assert_error(httpx.post(gateway.url + "/v1/completions", json=body), 401)
    assert error["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer nope"}
    assert_error(httpx.post(gateway.url + "/v1/completions", json=body, headers=wrong), 401)
    assert_error(httpx.get(gateway.url + "/v1/models"), 401)
    assert post(gateway, "/v1/completions", body).status_code == 200
    for path in ["/health", "/live", "/metrics"]:
        assert httpx.get(gateway.url + path).status_code == 200, path
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="bad", max_retries=0).models.list()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": ["a", "b"], "n": 100}, "n"),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, None),
        ("/v1/completions", {"prompt": "hi", "temperature": "warm"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "hi", "grammar": "root ::= nothing"}, "grammar"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": [[5, 6], []]}, "prompt"),
        ("/v1/completions", {"prompt": [1, 999999]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools",
        ),
        ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
        (
            "/v1/completions",
            {"prompt": "hi", "stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
        ),
        *(
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **f}, p)
            for f, p in [
                ({"reasoning_effort": "extreme"}, "reasoning_effort"),
                ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
                ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
                ({"reasoning_format": "markdown"}, "reasoning_format"),
                ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
                ({"modalities": ["text", "audio"]}, "modalities"),
                ({"store": True}, "store"),
                ({"service_tier": "flex"}, "service_tier"),
                ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
                ({"web_search_options": {}}, "web_search_options"),
                ({"functions": [{"name": "f"}]}, "functions"),
                ({"verbosity": "low"}, "verbosity"),
                ({"top_logprobs": 2}, "top_logprobs"),
                ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
            ]
        ),
        ("/tokenize", {"text": "wrong field"}, "content"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
    ],
)
def test_bad_requests(gateway: Proc, path: str, body: dict, param: str | None) -> None:
    assert_error(post(gateway, path, body), 400, param)


def test_fields_that_ask_for_nothing_are_accepted(gateway: Proc) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1,
        "store": False,
        "service_tier": "auto",
        "modalities": ["text"],
        "metadata": {"team": "a"},
        "user": "u1",
        "prompt_cache_key": "k",
        "stream_options": {"include_obfuscation": False},
    }
    assert post(gateway, "/v1/chat/completions", body).status_code == 200


def test_bad_json_and_content(gateway: Proc) -> None:
    response = httpx.post(
        gateway.url + "/v1/completions",
        content=b'{"prompt": ',
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert "JSON" in assert_error(response, 400)["message"]
    response = httpx.post(gateway.url + "/v1/completions", content=b"[1, 2]", headers=AUTH)
    assert_error(response, 400)


def test_prompt_too_long(gateway: Proc) -> None:
    prompt = "the cat " * CTX
    error = assert_error(post(gateway, "/v1/completions", {"prompt": prompt}), 400)
    assert error["code"] == "context_length_exceeded"
    assert str(CTX) in error["message"]
    messages = [{"role": "user", "content": prompt}]
    assert_error(post(gateway, "/v1/chat/completions", {"messages": messages}), 400)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-long", prompt=prompt)


def test_unknown_model(gateway: Proc) -> None:
    error = assert_error(post(gateway, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_body_too_large(gateway: Proc) -> None:
    big = {"prompt": "x" * (MAX_BODY + 1)}
    assert_error(post(gateway, "/v1/completions", big), 413)

    def chunked():  # no Content-Length: the limit is counted as the body streams in
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"y" * 1024
        yield b'"}'

    response = httpx.post(
        gateway.url + "/v1/completions",
        content=chunked(),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert_error(response, 413)


def test_queue_full_is_503_with_retry_after(gateway: Proc) -> None:
    """One slot and one queue place: a third long request is turned away."""
    body = {
        "prompt": "once upon a time",
        "max_tokens": CTX - 16,
        "ignore_eos": True,
        "stream": True,
    }
    with ExitStack() as stack:
        running = stack.enter_context(
            httpx.stream("POST", gateway.url + "/v1/completions", json=body, headers=AUTH)
        )
        lines = running.iter_lines()  # kept: a collected iterator closes the stream
        assert next(lines).startswith("data: ")  # it has the slot
        # The queued stream's headers wait for its first token: send it from a raw socket.
        queued = stack.enter_context(raw_request(gateway, "/v1/completions", body))
        wait_until_queued(gateway, 1)
        response = post(gateway, "/v1/completions", {**body, "stream": False})
        error = assert_error(response, 503)
        assert error["code"] == "queue_full"
        assert int(response.headers["Retry-After"]) >= 1
        queued.close()
    # Both streams were dropped, so their requests were cancelled: the slot serves again.
    # The queued one leaves the queue when the worker hears of the cancel, a moment after the
    # socket closed (a request sent at once could still meet the full queue, on a fast CPU).
    wait_until_queued(gateway, 0)
    assert post(gateway, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def raw_request(gateway: Proc, path: str, body: object) -> socket.socket:
    """A POST sent on a plain socket, its answer left unread."""
    payload = json.dumps(body).encode()
    host, port = gateway.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {AUTH['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def wait_until_queued(gateway: Proc, depth: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(gateway.url + "/health", timeout=5).json().get("queue_depth") != depth:
        assert time.monotonic() < deadline, "the request never reached the worker's queue"
        time.sleep(0.02)


def test_worker_missing_or_mismatched(tmp_path: Path, long_model_path: Path) -> None:
    """No worker at the endpoint, or one with another vocabulary: 503, never a wrong answer."""
    other_vocab = write_tiny_model(tmp_path / "other.gguf", shape=ModelShape(extra_vocab=16))
    with ExitStack() as stack:
        mismatched = stack.enter_context(start_worker(other_vocab, wait=False, slots=1))
        nowhere = stack.enter_context(
            start_gateway(long_model_path, f"tcp://127.0.0.1:{free_port()}", wait=False)
        )
        refusing = stack.enter_context(
            start_gateway(long_model_path, mismatched.endpoint, wait=False)
        )
        for proc, reason in [(nowhere, "not connected"), (refusing, "different vocabulary")]:
            wait_http(proc, "/live")
            wait_for_health_error(proc, reason)
            request = {"prompt": "hi", "max_tokens": 2}
            response = httpx.post(proc.url + "/v1/completions", json=request, timeout=10)
            error = assert_error(response, 503)
            assert error["type"] == "unavailable_error" and reason in error["message"]
        assert nowhere.stop() == 0  # SIGTERM: a clean exit


def wait_for_health_error(proc: Proc, reason: str, timeout: float = 30.0) -> None:
    """Wait until /health answers 503 with reason in its message."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(proc.url + "/health")
        if response.status_code == 503 and reason in response.json()["error"]["message"]:
            return
        time.sleep(0.1)
    proc.fail(f"/health never answered 503 with {reason!r}")
