"""Two real workers on the tiny model behind one gateway: load spread, prefix affinity, and a
worker killed under load (its requests without a token go to the other; it rejoins).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from loomserve.gateway.workers.routing import PREFIX_BLOCK_TOKENS
from loomserve.worker.cache.prefix_cache import usable_prefix
from tests.procs import Proc, Samples, free_port, scrape_metrics, start_gateway, start_worker
from tests.tiny_model import ModelShape, write_tiny_model

TEXT = (
    "once upon a time there lived a small cat and a big dog by the river in one house "
    "and the cat said hello to the dog and the dog said hello to the tree "
)


@dataclass(slots=True)
class Replicas:
    """Two workers (with their metrics URLs) and one gateway routing to both."""

    workers: list[Proc]
    metrics_urls: list[str]
    gateway: Proc

    def routed(self) -> dict[str, float]:
        """Requests the gateway sent to each worker so far."""
        return per_worker(
            scrape_metrics(self.gateway.url + "/metrics"), "worker_requests_routed_total"
        )

    def completion(self, prompt: str | list[int], max_tokens: int = 8) -> dict:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = httpx.post(self.gateway.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()


def per_worker(samples: Samples, metric: str) -> dict[str, float]:
    """A per-worker metric's value by worker endpoint."""
    name = f"loomserve:{metric}"
    return {dict(labels)["worker"]: value for (n, labels), value in samples.items() if n == name}


def worker_sample(url: str, name: str) -> float:
    return sum(v for (n, _), v in scrape_metrics(url).items() if n == f"loomserve:{name}")


def health(gateway: Proc) -> dict:
    return httpx.get(gateway.url + "/health", timeout=5).json()


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def replicas(tiny_model_path: Path) -> Iterator[Replicas]:
    with ExitStack() as stack:
        ports = [free_port(), free_port()]
        workers = [
            stack.enter_context(start_worker(tiny_model_path, slots=2, metrics_port=port))
            for port in ports
        ]
        gateway = stack.enter_context(start_gateway(tiny_model_path, [w.endpoint for w in workers]))
        wait_until(lambda: health(gateway).get("workers_ready") == 2, 20, "both workers ready")
        urls = [f"http://127.0.0.1:{port}/metrics" for port in ports]
        yield Replicas(workers, urls, gateway)


def test_both_workers_take_load(replicas: Replicas) -> None:
    body = health(replicas.gateway)
    assert (body["workers_ready"], body["workers"], body["slots_idle"]) == (2, 2, 4)
    finished_before = [
        worker_sample(url, "requests_finished_total") for url in replicas.metrics_urls
    ]
    prompts = [f"{word} story number {index}" for index, word in enumerate(TEXT.split()[:8])]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: replicas.completion(p, max_tokens=24), prompts))
    assert all(r["usage"]["completion_tokens"] == 24 for r in results)
    routed = replicas.routed()
    assert set(routed) == {w.endpoint for w in replicas.workers}
    assert sum(routed.values()) >= len(prompts)
    finished = [worker_sample(url, "requests_finished_total") for url in replicas.metrics_urls]
    served = [after - before for after, before in zip(finished, finished_before, strict=True)]
    assert sum(served) == len(prompts) and min(served) > 0, served  # both took some
    samples = scrape_metrics(replicas.gateway.url + "/metrics")
    assert set(per_worker(samples, "worker_up").values()) == {1.0}

    def none_in_flight() -> bool:  # the gauges are refreshed a few times a second
        samples = scrape_metrics(replicas.gateway.url + "/metrics")
        return set(per_worker(samples, "worker_requests_in_flight").values()) == {0.0}

    wait_until(none_in_flight, 2, "no request in flight")


def test_a_shared_prefix_stays_on_one_worker_and_hits_its_cache(replicas: Replicas) -> None:
    tokens = httpx.post(replicas.gateway.url + "/tokenize", json={"content": TEXT * 3}).json()
    prefix = tokens["tokens"][: 2 * PREFIX_BLOCK_TOKENS]
    assert len(prefix) == 2 * PREFIX_BLOCK_TOKENS
    before = replicas.routed()
    samples = scrape_metrics(replicas.gateway.url + "/metrics")
    hits_before = sum(per_worker(samples, "worker_prefix_affinity_hits_total").values())
    cached = []
    for suffix in range(6):
        result = replicas.completion([*prefix, 300 + suffix, 301 + suffix], max_tokens=4)
        cached.append(result["usage"]["prompt_tokens_details"]["cached_tokens"])
    after = replicas.routed()
    moved = {w: after[w] - before.get(w, 0) for w in after}
    assert sorted(moved.values()) == [0, 6], moved  # all six on one worker
    samples = scrape_metrics(replicas.gateway.url + "/metrics")
    assert sum(per_worker(samples, "worker_prefix_affinity_hits_total").values()) - hits_before >= 5
    # After the first, each request found the shared prefix in that worker's cache, and kept
    # all of it but what its last 64 tokens, evaluated again, take (usable_prefix).
    reused = usable_prefix(len(prefix), len(prefix) + 2, 512)
    assert reused == len(prefix) + 2 - 64
    assert cached[1:] == [reused] * 5, cached


def test_a_worker_with_another_model_is_refused_and_named(
    replicas: Replicas, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = write_tiny_model(
        tmp_path_factory.mktemp("other") / "other.gguf", shape=ModelShape(extra_vocab=7)
    )
    good = replicas.workers[0]
    with start_worker(other) as stranger:
        model = replicas.gateway.args[replicas.gateway.args.index("--model") + 1]
        gateway = start_gateway(Path(model), [stranger.endpoint, good.endpoint])
        with gateway:
            wait_until(lambda: health(gateway).get("workers_ready") == 1, 10, "one ready")
            assert health(gateway)["workers"] == 2

            def refusals() -> list[dict]:
                return [
                    json.loads(line)
                    for line in gateway.logs().splitlines()
                    if "refusing to serve with this worker" in line
                ]

            # The good worker can be ready before the stranger's Hello has been refused.
            wait_until(lambda: bool(refusals()), 10, "the refusal logged")
            assert refusals()[0]["worker"] == stranger.endpoint
            assert "different vocabulary" in refusals()[0]["reason"]
            body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
            for _ in range(4):
                response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)
                assert response.status_code == 200, response.text
            routed = per_worker(
                scrape_metrics(gateway.url + "/metrics"), "worker_requests_routed_total"
            )
            assert routed == {good.endpoint: 4.0}, routed


# --- a worker killed under load ---------------------------------------------------------------

CTX = 8192
LONG_TOKENS = 2500  # a stream lasting a few seconds on the tiny model


@dataclass(slots=True)
class StreamOutcome:
    """How a stream read in a thread ended."""

    first_token: threading.Event = field(default_factory=threading.Event)
    events: list[str] = field(default_factory=list)


def read_stream(url: str, outcome: StreamOutcome) -> None:
    body = {"prompt": "once upon a time", "max_tokens": LONG_TOKENS, "ignore_eos": True}
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                outcome.events.append(line[6:])
                outcome.first_token.set()


def test_a_killed_worker_loses_only_its_started_requests_and_rejoins(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model = write_tiny_model(
        tmp_path_factory.mktemp("long") / "tiny-long.gguf", shape=ModelShape(context_length=CTX)
    )
    ports = [free_port(), free_port()]
    options = {"slots": 1, "ctx_size": CTX}
    with ExitStack() as stack:
        workers = [stack.enter_context(start_worker(model, port=p, **options)) for p in ports]
        gateway = stack.enter_context(start_gateway(model, [w.endpoint for w in workers]))
        wait_until(lambda: health(gateway).get("workers_ready") == 2, 20, "both workers ready")
        url = gateway.url + "/v1/completions"
        threads = ThreadPoolExecutor(6)
        stack.callback(threads.shutdown)

        # One long stream running on each worker (the second goes where a slot is free)...
        streams = [StreamOutcome(), StreamOutcome()]
        for outcome in streams:
            threads.submit(read_stream, url, outcome)
            assert outcome.first_token.wait(20), "a stream did not start"
        # ...and one short request queued behind each.
        short = {"prompt": "hello world", "max_tokens": 8, "temperature": 0}
        queued = [threads.submit(httpx.post, url, json=short, timeout=60) for _ in range(2)]
        wait_until(lambda: health(gateway).get("queue_depth") == 2, 10, "both queued")
        in_flight = per_worker(
            scrape_metrics(gateway.url + "/metrics"), "worker_requests_in_flight"
        )
        assert in_flight == {w.endpoint: 2.0 for w in workers}, in_flight

        victim, survivor = workers
        victim.kill()

        # The queued requests both finish: the victim's was sent to the survivor.
        for future in queued:
            response = future.result(timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 8
        # The victim's stream had tokens out: it ends with an error; the other completes.
        wait_until(lambda: all(s.events and s.events[-1] for s in streams), 30, "streams end")
        threads.shutdown(wait=True)
        endings = sorted(
            "done" if s.events[-1] == "[DONE]" else json.loads(s.events[-1])["error"]["type"]
            for s in streams
        )
        assert endings == ["done", "unavailable_error"], endings
        samples = scrape_metrics(gateway.url + "/metrics")
        assert samples["loomserve:requests_rerouted_total", (("reason", "lost"),)] == 1
        up = per_worker(samples, "worker_up")
        assert up == {victim.endpoint: 0.0, survivor.endpoint: 1.0}, up

        # The gateway keeps answering, through the survivor.
        assert health(gateway)["workers_ready"] == 1
        response = httpx.post(url, json=short, timeout=30)
        assert response.status_code == 200, response.text

        # The victim, restarted on its address, rejoins without a gateway restart.
        stack.enter_context(start_worker(model, port=ports[0], **options))
        wait_until(lambda: health(gateway).get("workers_ready") == 2, 20, "the victim rejoins")
        before = per_worker(
            scrape_metrics(gateway.url + "/metrics"), "worker_requests_routed_total"
        )
        # It gets work once its heartbeats show free slots: a few bounded rounds of traffic.
        for _ in range(5):
            with ThreadPoolExecutor(4) as pool:
                answers = list(
                    pool.map(lambda _: httpx.post(url, json=short, timeout=30), range(4))
                )
            assert all(answer.status_code == 200 for answer in answers)
            metrics = scrape_metrics(gateway.url + "/metrics")
            after = per_worker(metrics, "worker_requests_routed_total")
            if after.get(victim.endpoint, 0) > before.get(victim.endpoint, 0):
                break
            time.sleep(0.5)
        assert after[victim.endpoint] > before[victim.endpoint]
        assert "worker in rotation" in gateway.logs()
