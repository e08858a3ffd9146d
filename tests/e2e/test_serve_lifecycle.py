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
from tests.procs import Proc, scrape_metrics


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
        self.chunks: list[dict] = []
        self.first = threading.Event()
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line.removeprefix("data: ")))
                    self.first.set()

    def join(self) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive()

    def finishes(self) -> list[str]:
        return [c["finish_reason"] for b in self.chunks for c in b["choices"] if c["finish_reason"]]

    def whole(self) -> bool:
        usage = self.chunks[-1].get("usage") if self.chunks else None
        done = usage is not None and usage["completion_tokens"] == self.body["max_tokens"]
        return self.status == 200 and self.finishes() == ["length"] and done


@pytest.fixture()
def one_at_a_time(tiny_model_path: Path, other_model_path: Path) -> Iterator[Proc]:
    # A long --worker-timeout: a worker stopped (SIGSTOP) below is not taken for lost.
    extra = ("--models-max", "1", "--worker-timeout", "60", "--model-load-timeout", "3")
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
    assert stream.whole(), (stream.status, stream.finishes())
    # Once a is idle, b loads in its place.
    assert complete(url, "b", PROMPTS[1], max_tokens=2)
    evicted = [e["model"] for e in events(one_at_a_time, "evicting the least recently used model")]
    assert evicted == ["a"]
