"""A stream that outlives --request-timeout: the client gets what came before, then the
timeout as the stream's last event, and the worker's slot is freed at once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.procs import free_port, scrape_metrics, start_gateway, start_worker

TIMEOUT_S = 0.5


def test_a_stream_past_the_request_timeout_ends_with_the_timeout_and_frees_its_slot(
    tiny_model_path: Path,
) -> None:
    # A thousand tokens in one slot (the tiny model trained on 1024): seconds, past the timeout.
    metrics_port = free_port()
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    with (
        start_worker(tiny_model_path, slots=1, ctx_size=1024, metrics_port=metrics_port) as worker,
        start_gateway(tiny_model_path, worker.endpoint, request_timeout=TIMEOUT_S) as gateway,
    ):
        body = {"prompt": "a", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        events: list[dict] = []
        started = time.monotonic()
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", gateway.url + "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line.removeprefix("data: ")))
        took = time.monotonic() - started
        texts = [event for event in events if "choices" in event]
        assert texts, "tokens came before the deadline"
        assert "error" in events[-1] and "choices" not in events[-1]
        error = events[-1]["error"]
        assert error["type"] == "timeout_error" and "request timeout" in error["message"]
        assert TIMEOUT_S <= took < TIMEOUT_S + 5
        # The gateway cancelled it in the worker: the slot is free well before its 1000 tokens.
        deadline = time.monotonic() + 5
        while scrape_metrics(metrics)[("loomserve:num_requests_running", ())] != 0:
            assert time.monotonic() < deadline, "the worker kept running the request"
            time.sleep(0.05)
