"""Scale-in as an autoscaler does it (docs/deployment.md): one of two workers gets SIGTERM in
the middle of a generation. Its request runs to the end, requests sent meanwhile are served by
the other worker, no client sees an error, and the drained worker exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from tests.conftest import LONG_CTX
from tests.procs import start_gateway, start_worker

CTX = LONG_CTX
GENERATED = 3000  # seconds of generation on the tiny model, on a loaded machine


def busy_worker(gateway_url: str, request_id: str, timeout: float = 10.0) -> str:
    """The endpoint of the worker whose slot runs the request, from GET /slots."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in httpx.get(gateway_url + "/slots", timeout=10).json()["workers"]:
            if any(request_id in (s["request_id"] or "") for s in worker.get("slots", [])):
                return worker["endpoint"]
        time.sleep(0.05)
    raise AssertionError(f"no worker shows {request_id} in /slots")


def test_a_worker_scaled_in_finishes_its_requests(long_model_path: Path) -> None:
    with ExitStack() as stack:
        workers = [
            stack.enter_context(
                start_worker(long_model_path, slots=1, ctx_size=CTX, shutdown_timeout=60)
            )
            for _ in range(2)
        ]
        gateway = stack.enter_context(start_gateway(long_model_path, [w.endpoint for w in workers]))
        body = {
            "prompt": "once upon a time",
            "max_tokens": GENERATED,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events: list[str] = []

        def stream() -> None:
            with httpx.stream(
                "POST",
                gateway.url + "/v1/completions",
                json=body,
                headers={"X-Request-Id": "scale-in-1"},
                timeout=120,
            ) as response:
                assert response.status_code == 200
                events.extend(
                    line[6:] for line in response.iter_lines() if line.startswith("data: ")
                )

        reader = threading.Thread(target=stream)
        reader.start()
        endpoint = busy_worker(gateway.url, "scale-in-1")
        leaving = next(w for w in workers if w.endpoint == endpoint)
        staying = next(w for w in workers if w is not leaving)
        leaving.popen.send_signal(signal.SIGTERM)

        # Meanwhile the gateway keeps serving, on the worker that stays.
        for i in range(4):
            answer = httpx.post(
                gateway.url + "/v1/completions",
                json={"prompt": f"request {i}", "max_tokens": 4},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
        reader.join(timeout=120)
        assert not reader.is_alive(), "the draining worker's stream did not end"

        assert events and events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == GENERATED  # every token, none lost
        assert leaving.popen.wait(timeout=30) == 0
        assert staying.alive()
        log = leaving.logs()
        assert "stopping: draining requests" in log
