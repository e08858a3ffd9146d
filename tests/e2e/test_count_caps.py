"""Count-only endpoints and megabytes of text (issue 60, item 4): /v1/messages/count_tokens,
/v1/responses/input_tokens and /tokenize refuse text that surely makes more tokens than the
model's context, with a 400 naming the field, before tokenizing it; a stream running beside
them goes on (the gateway's link to its worker stays up). Below the cap they still count.

Real worker and gateway processes on the tiny model (tests/procs.py).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

from tests.e2e.test_faults_gateway import CTX, LONG
from tests.procs import start_gateway, start_worker

HUGE = "x " * 3_450_000  # 6.9 MB, as the audit's bodies


def test_megabyte_counts_are_refused_and_a_stream_goes_on(long_model_path: Path) -> None:
    """Two of each count-only request with 6.9 MB of text, beside a live stream: each is a
    400 context_length_exceeded naming its field; the stream ends whole, and the worker
    (which gives a silent gateway up after 1 s) never lost the gateway."""
    with ExitStack() as stack:
        worker = stack.enter_context(
            start_worker(long_model_path, slots=2, ctx_size=CTX, gateway_timeout=1.0)
        )
        gateway = stack.enter_context(
            start_gateway(
                long_model_path,
                worker.endpoint,
                stream_buffer_tokens=CTX,
                max_body_bytes=16 * 2**20,
            )
        )
        url = gateway.url
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        events: list[str] = []
        started, stop = threading.Event(), threading.Event()

        def stream() -> None:
            body = {**LONG, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        started.set()
                    if stop.is_set():
                        return

        turns = [{"role": "user", "content": HUGE}]
        refusals = [
            ("/v1/messages/count_tokens", {"model": model, "messages": turns}, None),
            ("/v1/responses/input_tokens", {"model": model, "input": HUGE}, "input"),
            ("/tokenize", {"content": HUGE}, "content"),
        ] * 2
        with ThreadPoolExecutor(2) as pool:
            streaming = pool.submit(stream)
            assert started.wait(30), "the stream did not start"
            for path, body, param in refusals:
                sent = time.monotonic()
                response = httpx.post(url + path, json=body, timeout=60)
                assert response.status_code == 400, (path, response.text[:300])
                error = response.json()["error"]
                if path.startswith("/v1/messages"):  # Anthropic's error shape: no code, param
                    assert error["type"] == "invalid_request_error", error
                    assert "maximum context length" in error["message"], error
                else:
                    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
                print(f"{path}: 400 in {time.monotonic() - sent:.2f}s")
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            assert not streaming.done(), events[-3:]  # still streaming, no error
            stop.set()
            streaming.result(timeout=60)
        assert events and not any('"error"' in event for event in events), events[-3:]
        assert "it was silent for" not in worker.logs()  # the worker never gave the gateway up


def test_a_prompt_longer_than_a_slot_is_still_counted(tiny_model_path: Path) -> None:
    """The count cap is the model's training context, not the slot's: a text of more tokens
    than a 512-token slot holds is counted, not refused."""
    with (
        start_worker(tiny_model_path, ctx_size=512, slots=1) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        text = "hello world " * 300
        tokens = httpx.post(gateway.url + "/tokenize", json={"content": text}).json()["tokens"]
        assert len(tokens) > 512
        model = httpx.get(gateway.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
        counted = httpx.post(gateway.url + "/v1/messages/count_tokens", json=body)
        assert counted.status_code == 200, counted.text
        assert counted.json()["input_tokens"] > len(tokens)
