"""Things going away: clients mid-request, a gateway, the worker (the gateways recover).

Generations here are long (ignore_eos over a 16k context, about ten seconds on the tiny
model), so a slot that frees within a second was freed by a cancel, not by finishing.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import LONG_CTX
from tests.procs import Proc, free_port, start_gateway, start_worker, wait_http

CTX = LONG_CTX
LONG = {"prompt": "once upon a time", "max_tokens": CTX - 16, "ignore_eos": True}


def health(gateway: Proc) -> dict:
    return httpx.get(gateway.url + "/health", timeout=5).json()


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until check() held; fails after timeout."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - started


def slot_state(gateway: Proc, idle: int) -> Callable[[], bool]:
    return lambda: health(gateway).get("slots_idle") == idle


def test_gone_clients_and_gateways_free_their_slots(long_model_path: Path) -> None:
    """A client that disconnects (streaming or not), and a gateway killed with SIGKILL."""
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(long_model_path, slots=1, ctx_size=CTX))
        observer = stack.enter_context(start_gateway(long_model_path, worker.endpoint))
        victim = stack.enter_context(start_gateway(long_model_path, worker.endpoint))
        url = observer.url + "/v1/completions"

        with httpx.stream("POST", url, json={**LONG, "stream": True}) as stream:
            lines = stream.iter_lines()  # kept: a collected iterator closes the stream
            assert next(lines).startswith("data: ")
            wait_until(slot_state(observer, 0), 2, "the slot taken")
        wait_until(slot_state(observer, 1), 1, "the slot freed after a stream's client left")

        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=LONG, timeout=0.3)
        wait_until(slot_state(observer, 1), 1, "the slot freed after a client gave up")
        metrics = httpx.get(observer.url + "/metrics").text
        assert 'loomserve:client_disconnects_total{model_name="tiny-long"} 2.0' in metrics

        stream = stack.enter_context(
            httpx.stream("POST", victim.url + "/v1/completions", json={**LONG, "stream": True})
        )
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        wait_until(slot_state(observer, 0), 2, "the slot taken")
        victim.kill()
        seconds = wait_until(slot_state(observer, 1), 8, "the slot freed after a gateway died")
        print(f"slot freed {seconds:.2f}s after its gateway died")
        victim_id = re.search(r'"gateway_id": "(gw-[^"]+)"', victim.logs()).group(1)
        lost = [line for line in worker.logs().splitlines() if "gateway lost" in line]
        assert any(victim_id in line for line in lost), lost


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
        sdk_stream = sdk.completions.create(
            model="tiny-long",
            prompt=LONG["prompt"],
            max_tokens=LONG["max_tokens"],
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert next(iter(sdk_stream)).choices

        first_worker.kill()

        # Both streams end with an error event, not [DONE].
        events = [line[6:] for line in raw_lines if line.startswith("data: ")]
        assert events and events[-1] != "[DONE]"
        assert json.loads(events[-1])["error"]["type"] == "unavailable_error"
        with pytest.raises(openai.APIError):
            for _ in sdk_stream:
                pass
        for gateway in gateways:
            wait_until(lambda g=gateway: "error" in health(g), 5, "health 503")
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
