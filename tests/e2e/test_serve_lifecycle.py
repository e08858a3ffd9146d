"""`serve`'s several-model lifecycle on the real engine (issue 60): an eviction decides on the
gateway's own in-flight counts, not on heartbeats that lag them; an unload lets running
streams end and refuses new requests meanwhile; a bad file in --models-dir fails its model
only."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loomserve.cli.models import LOAD_GRACE_SECONDS
from tests.e2e.test_models import PROMPTS, complete, states, wait_until
from tests.e2e.test_serve_models import events, start_serve
from tests.procs import Proc, free_port, scrape_metrics, wait_http


class Stream:
    """A streamed completion read on a thread: its chunks, and whether it ended whole."""

    def __init__(self, url: str, model: str, max_tokens: int) -> None:
        self.body = {
            "model": model,
            "prompt": PROMPTS[2],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self.url = url
        self.status = 0
        self.error = ""
        self.chunks: list[dict] = []
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
            self.status = r.status_code
            if r.status_code != 200:
                self.error = r.read().decode()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line.removeprefix("data: ")))
                    self.first.set()

    def join(self) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive()

    def finishes(self) -> list[str]:
        choices = [c for body in self.chunks for c in body.get("choices", [])]  # or an error
        return [c["finish_reason"] for c in choices if c["finish_reason"]]

    def whole(self) -> bool:
        usage = self.chunks[-1].get("usage") if self.chunks else None
        done = usage is not None and usage["completion_tokens"] == self.body["max_tokens"]
        return self.status == 200 and self.finishes() == ["length"] and done


@pytest.fixture()
def one_at_a_time(tiny_model_path: Path, other_model_path: Path) -> Iterator[Proc]:
    # Long --worker-timeout and --gateway-timeout: a worker stopped (SIGSTOP) below and its
    # gateway do not take each other for lost. A --shutdown-timeout of 0: a worker stopped
    # under running streams would cut them at once.
    extra = ("--models-max", "1", "--worker-timeout", "60", "--gateway-timeout", "60")
    extra += ("--model-load-timeout", "3")
    extra += ("--shutdown-timeout", "0")
    with start_serve(tiny_model_path, other_model_path, *extra) as proc:
        wait_until(lambda: states(proc)["a"] == "loaded", "the first model")
        yield proc


def _worker_pid(proc: Proc, child: str) -> int:
    return [e["pid"] for e in events(proc, "started") if e["child"] == child][-1]


def _open_on(proc: Proc, endpoint_part: str) -> float:
    samples = scrape_metrics(proc.url + "/metrics")
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "loomserve:worker_requests_in_flight" and endpoint_part in dict(labels)["worker"]
    )


def _completes(url: str, model: str) -> bool:
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": 2}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code in (200, 503), response.text
    return response.status_code == 200


def test_eviction_never_picks_a_model_the_gateway_has_requests_on(one_at_a_time: Proc) -> None:
    """The worker of a is stopped (SIGSTOP), so its heartbeats say what they said last: idle.
    The gateway has a request in flight on a: a request for b must not evict a."""
    url = one_at_a_time.url
    complete(url, "a", PROMPTS[0], max_tokens=2)
    threading.Event().wait(LOAD_GRACE_SECONDS + 1.5)  # a is old and idle in its heartbeats
    pid = _worker_pid(one_at_a_time, "worker-a")
    os.kill(pid, signal.SIGSTOP)
    try:
        stream = Stream(url, "a", max_tokens=24)
        wait_until(lambda: _open_on(one_at_a_time, "model-1-") >= 1, "a's request to be sent")
        refused = httpx.post(
            url + "/v1/completions",
            json={"model": "b", "prompt": PROMPTS[1], "max_tokens": 2},
            timeout=60,
        )
        assert refused.status_code == 503, refused.text  # a is busy: b waited, then 503
        assert "retry-after" in refused.headers
        assert not events(one_at_a_time, "evicting the least recently used model")
    finally:
        os.kill(pid, signal.SIGCONT)
    stream.join()
    assert stream.whole(), (stream.status, stream.error, stream.finishes())
    # Once a is idle, b loads in its place (a request may time out while a drains and stops).
    wait_until(lambda: _completes(url, "b"), "b to load in a's place")
    evicted = [e["model"] for e in events(one_at_a_time, "evicting the least recently used model")]
    assert evicted == ["a"]


def test_an_unload_lets_running_streams_end_and_refuses_new_requests(one_at_a_time: Proc) -> None:
    """Streams running on a when it is unloaded end whole (the worker is stopped only after
    them), a new request for a meanwhile gets a retryable 503, and once a is unloaded the
    next request loads it again."""
    url = one_at_a_time.url
    streams = [Stream(url, "a", max_tokens=400) for _ in range(2)]
    for stream in streams:
        assert stream.first.wait(60)
    unloaded = httpx.post(url + "/models/unload", json={"model": "a"}, timeout=30)
    assert unloaded.status_code == 200
    assert unloaded.json()["status"]["value"] == "unloading"
    assert "503" in unloaded.json()["message"]
    refused = httpx.post(
        url + "/v1/completions", json={"model": "a", "prompt": "hi", "max_tokens": 2}, timeout=30
    )
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "model_unloading"
    assert refused.headers["retry-after"]
    for stream in streams:
        stream.join()
        assert stream.whole(), (stream.status, stream.finishes(), len(stream.chunks))
    wait_until(lambda: states(one_at_a_time)["a"] == "unloaded", "a to unload")
    assert not events(
        one_at_a_time, "unload drain ran out; stopping the model with requests running"
    )
    stopped = [e for e in events(one_at_a_time, "stopped") if e["child"] == "worker-a"]
    assert stopped and stopped[-1]["status"] == "exit 0"
    # The next request loads a again (one may time out, under --model-load-timeout 3).
    wait_until(lambda: _completes(url, "a"), "a to load again")


def test_a_bad_file_in_models_dir_fails_its_model_only(
    tiny_model_path: Path, other_model_path: Path, tmp_path: Path
) -> None:
    """A file with GGUF's magic and a bad header, and a good model's first 200 kB: both are
    listed unavailable with the reason, in /v1/models and the log; the good models serve."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "a.gguf").symlink_to(tiny_model_path)
    (folder / "b.gguf").symlink_to(other_model_path)
    (folder / "bad.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 64)
    (folder / "trunc.gguf").write_bytes(tiny_model_path.read_bytes()[:200_000])
    port = free_port()
    args = ["serve", "--models-dir", str(folder), "--port", str(port), "--slots", "2"]
    args += ["--ctx-size", "512", "--threads", "1", "--log-json", "--heartbeat-interval", "0.25"]
    with Proc("serve", args) as proc:
        proc.url = f"http://127.0.0.1:{port}"
        wait_http(proc, "/health")
        cards = {c["id"]: c["status"] for c in httpx.get(proc.url + "/v1/models").json()["data"]}
        assert set(cards) == {"a", "b", "bad", "trunc"}
        for name in ("bad", "trunc"):
            assert cards[name]["value"] == "unavailable" and cards[name]["failed"] is True
            assert f"{name}.gguf" in cards[name]["reason"]
        assert complete(proc.url, "a", PROMPTS[0], max_tokens=2)
        assert complete(proc.url, "b", PROMPTS[0], max_tokens=2)
        refused = httpx.post(
            proc.url + "/v1/completions",
            json={"model": "trunc", "prompt": "hi", "max_tokens": 2},
            timeout=30,
        )
        assert refused.status_code == 503 and "trunc.gguf" in refused.json()["error"]["message"]
        logged = {
            e["model"]
            for e in events(proc, "model unavailable: its file cannot be loaded; the others serve")
        }
        assert logged == {"bad", "trunc"}
        wait_until(lambda: bool(events(proc, "ready")), "serve to say it is ready")
        assert proc.alive()


def test_the_unload_drain_is_bounded(tiny_model_path: Path, other_model_path: Path) -> None:
    """--unload-drain 0: the workers are stopped at once, the stream is cut, and the log says
    so. The worker is held (SIGSTOP) while the unload runs out, so its stream cannot end
    first."""
    extra = ("--unload-drain", "0", "--shutdown-timeout", "0")
    extra += ("--worker-timeout", "60", "--gateway-timeout", "60")
    with start_serve(tiny_model_path, other_model_path, *extra) as proc:
        wait_until(lambda: states(proc)["a"] == "loaded", "the first model")
        stream = Stream(proc.url, "a", max_tokens=480)
        assert stream.first.wait(60)
        pid = _worker_pid(proc, "worker-a")
        os.kill(pid, signal.SIGSTOP)
        try:
            unloaded = httpx.post(proc.url + "/models/unload", json={"model": "a"}, timeout=30)
            assert unloaded.status_code == 200
            ran_out = "unload drain ran out; stopping the model with requests running"
            wait_until(lambda: bool(events(proc, ran_out)), "the drain to run out")
        finally:
            os.kill(pid, signal.SIGCONT)
        stream.join()
        assert not stream.whole()
        wait_until(lambda: states(proc)["a"] == "unloaded", "a to unload")
        assert [e["model"] for e in events(proc, ran_out)] == ["a"]
