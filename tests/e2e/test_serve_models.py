"""`loomserve serve` with two models on the real engine: loaded on demand, at most
--models-max at once (the least recently used idle one evicted, never a busy one), unloaded
when idle, and loaded or unloaded by operators through /models/load and /models/unload.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from loomserve.cli.models import LOAD_GRACE_SECONDS
from tests.e2e.test_models import PROMPTS, complete, states, wait_until
from tests.procs import Proc, free_port, wait_http


def start_serve(a: Path, b: Path, *extra: str) -> Proc:
    port = free_port()
    args = ["serve", "--model", f"a={a}", "--model", f"b={b}", "--port", str(port)]
    args += ["--slots", "2", "--ctx-size", "512", "--threads", "1", "--log-json"]
    args += ["--heartbeat-interval", "0.25", "--worker-timeout", "2", *extra]
    proc = Proc("serve", args)
    proc.url = f"http://127.0.0.1:{port}"
    wait_http(proc, "/health")
    return proc


def events(proc: Proc, name: str) -> list[dict]:
    """The JSON log lines of one event."""
    found = []
    for line in proc.logs().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == name:
                found.append(record)
    return found


@pytest.fixture(scope="module")
def one_at_a_time(tiny_model_path: Path, other_model_path: Path) -> Iterator[Proc]:
    with start_serve(tiny_model_path, other_model_path, "--models-max", "1") as proc:
        yield proc


def test_models_load_on_demand_one_at_a_time(one_at_a_time: Proc) -> None:
    url = one_at_a_time.url
    wait_until(lambda: states(one_at_a_time)["a"] == "loaded", "the first model")
    assert states(one_at_a_time)["b"] == "unloaded"
    warm_a = complete(url, "a", PROMPTS[0])
    started = time.monotonic()
    cold_b = complete(url, "b", PROMPTS[0])  # loads b, evicting the idle a
    cold_seconds = time.monotonic() - started
    assert states(one_at_a_time)["b"] == "loaded"
    assert states(one_at_a_time)["a"] in ("unloading", "unloaded")
    assert complete(url, "b", PROMPTS[0]) == cold_b
    # Back to a: loaded again, answering as before.
    assert complete(url, "a", PROMPTS[0]) == warm_a
    assert states(one_at_a_time)["b"] in ("unloading", "unloaded")
    evicted = [e["model"] for e in events(one_at_a_time, "evicting the least recently used model")]
    assert evicted[:2] == ["a", "b"]
    assert cold_seconds < 60
    # Requests that name no model get the first one.
    assert complete(url, None, PROMPTS[0]) == warm_a


def test_a_busy_model_is_never_evicted(one_at_a_time: Proc) -> None:
    """A request for b while a streams waits until a is idle; a's stream ends whole."""
    url = one_at_a_time.url
    complete(url, "a", PROMPTS[1], max_tokens=2)  # a is loaded,
    time.sleep(LOAD_GRACE_SECONDS)  # and old enough to be evicted were it idle
    body = {
        "model": "a",
        "prompt": PROMPTS[2],
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[str] = []
    streamed = threading.Event()
    ended: list[float] = []

    def stream_a() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(line)
                    streamed.set()
        ended.append(time.time())

    reader = threading.Thread(target=stream_a)
    reader.start()
    assert streamed.wait(60)
    evictions = len(events(one_at_a_time, "evicting the least recently used model"))
    complete(url, "b", PROMPTS[1], max_tokens=2)  # waits for a to go idle, then loads b
    reader.join(120)
    stream_ended = ended[0]
    bodies = [json.loads(chunk.removeprefix("data: ")) for chunk in chunks]
    choices = [choice for body in bodies for choice in body["choices"]]
    finishes = [choice["finish_reason"] for choice in choices if choice["finish_reason"]]
    assert finishes == ["length"]  # a ran to its end: nobody stopped its worker under it
    assert bodies[-1]["usage"]["completion_tokens"] == 480
    # a was evicted for b only once its stream had ended (heartbeats said it was idle).
    eviction = events(one_at_a_time, "evicting the least recently used model")[evictions]
    assert eviction["model"] == "a"
    evicted_at = datetime.fromisoformat(eviction["timestamp"]).timestamp()
    assert evicted_at >= stream_ended - 0.3, (evicted_at, stream_ended)


def test_operators_load_and_unload(one_at_a_time: Proc) -> None:
    url = one_at_a_time.url
    loaded = httpx.post(url + "/models/load", json={"model": "b"}, timeout=120)
    assert loaded.status_code == 200
    assert loaded.json() == {"success": True, "model": "b", "status": {"value": "loaded"}}
    unloaded = httpx.post(url + "/models/unload", json={"model": "b"}, timeout=30)
    assert unloaded.status_code == 200 and unloaded.json()["status"]["value"] == "unloading"
    wait_until(lambda: states(one_at_a_time)["b"] == "unloaded", "b to unload")
    missing = httpx.post(url + "/models/load", json={"model": "zz"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/health").status_code == 200  # nothing loaded, still healthy
    assert events(one_at_a_time, "model unloaded")


def test_an_idle_model_unloads_and_comes_back(
    tiny_model_path: Path, other_model_path: Path
) -> None:
    with start_serve(tiny_model_path, other_model_path, "--idle-unload", "2") as proc:
        first = complete(proc.url, "b", PROMPTS[3])  # both loaded now (--models-max 4)
        wait_until(lambda: states(proc) == {"a": "unloaded", "b": "unloaded"}, "idle unload")
        samples = httpx.get(proc.url + "/metrics").text
        assert 'loomserve:model_state{model_name="b",state="unloaded"} 1.0' in samples
        assert complete(proc.url, "b", PROMPTS[3]) == first
        idle = [e["model"] for e in events(proc, "model idle; unloading")]
        assert "a" in idle and "b" in idle


def test_one_model_under_its_served_name_unloads_when_idle(tiny_model_path: Path) -> None:
    """llama-server's --sleep-idle-seconds: one model, renamed, freed when idle and loaded
    again by the next request for it (the manager knows it by the name clients use)."""
    port = free_port()
    args = ["serve", "--model", str(tiny_model_path), "--served-model-name", "tiny-chat"]
    args += ["--idle-unload", "1", "--port", str(port), "--slots", "2", "--ctx-size", "512"]
    args += ["--threads", "1", "--log-json", "--heartbeat-interval", "0.25"]
    with Proc("serve", args) as proc:
        proc.url = f"http://127.0.0.1:{port}"
        wait_http(proc, "/health")
        wait_until(lambda: states(proc) == {"tiny-chat": "unloaded"}, "idle unload")
        assert complete(proc.url, "tiny-chat", PROMPTS[0], max_tokens=4)
        assert complete(proc.url, None, PROMPTS[0], max_tokens=4)  # the one model
        unknown = {"model": "x", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(proc.url + "/v1/completions", json=unknown).status_code == 404
