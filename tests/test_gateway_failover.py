"""Processes dying: the worker mid-stream (the gateways recover), a gateway (its slots freed)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import Proc, free_port, start_gateway, start_worker, wait_http
from tests.tiny_model import ModelShape, write_tiny_model

CTX = 8192  # ignore_eos generations this long outlive the failures under test


@pytest.fixture(scope="module")
def long_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("long") / "tiny-long.gguf"
    return write_tiny_model(path, shape=ModelShape(context_length=CTX))


LONG = {"prompt": "once upon a time", "max_tokens": CTX - 16, "ignore_eos": True}


def data_events(lines: Iterator[str]) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def health(gateway: Proc) -> httpx.Response:
    return httpx.get(gateway.url + "/health", timeout=5)


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_worker_death_ends_streams_and_gateways_recover(long_model_path: Path) -> None:
    port = free_port()
    with ExitStack() as stack:
        first_worker = stack.enter_context(
            start_worker(long_model_path, port=port, slots=2, ctx_size=CTX)
        )
        gateways = [
            stack.enter_context(start_gateway(long_model_path, first_worker.endpoint))
            for _ in range(2)
        ]
        raw = stack.enter_context(
            httpx.stream("POST", gateways[0].url + "/v1/completions", json={**LONG, "stream": True})
        )
        raw_lines = raw.iter_lines()
        assert next(raw_lines).startswith("data: ")
        sdk = openai.OpenAI(base_url=gateways[1].url + "/v1", api_key="x", max_retries=0)
        sdk_stream = sdk.completions.create(model="tiny-long", stream=True, **LONG)
        assert next(iter(sdk_stream)).choices[0].text is not None

        first_worker.kill()

        # Both streams end with an error event, not [DONE].
        events = data_events(raw_lines)
        assert events and events[-1] != "[DONE]"
        assert json.loads(events[-1])["error"]["type"] == "unavailable_error"
        with pytest.raises(openai.APIError):
            for _ in sdk_stream:
                pass
        for gateway in gateways:
            wait_until(lambda g=gateway: health(g).status_code == 503, 5, "health 503")
            response = httpx.post(gateway.url + "/v1/completions", json={"prompt": "hi"})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "worker_unavailable"

        # A new worker on the same endpoint: the gateways find it without a restart.
        stack.enter_context(start_worker(long_model_path, port=port, slots=2, ctx_size=CTX))
        for gateway in gateways:
            wait_http(gateway, "/health", timeout=15)
            body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
            response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=10)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4


def test_killed_gateway_frees_its_slots(long_model_path: Path) -> None:
    """A gateway that dies without a word: the worker notices and cancels its requests."""
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(long_model_path, slots=1, ctx_size=CTX))
        observer = stack.enter_context(start_gateway(long_model_path, worker.endpoint))
        victim = stack.enter_context(start_gateway(long_model_path, worker.endpoint))
        stream = stack.enter_context(
            httpx.stream("POST", victim.url + "/v1/completions", json={**LONG, "stream": True})
        )
        assert next(stream.iter_lines()).startswith("data: ")
        wait_until(lambda: health(observer).json().get("slots_idle") == 0, 2, "the slot taken")

        victim.kill()

        started = time.monotonic()
        wait_until(lambda: health(observer).json().get("slots_idle") == 1, 15, "the slot freed")
        print(f"slot freed {time.monotonic() - started:.2f}s after the gateway died")
        assert "cancel" in worker.logs().lower()
