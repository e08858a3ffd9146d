"""Faults and poison input: one request, one stalled gateway or one broken engine
must never take the service down, and a shutdown must end every stream with a word.

Real worker and gateway processes on the tiny model; the worker's forward pass fails on demand
through LOOMSERVE_TEST_FAIL_DECODE (worker/tick/faults.py), and a fake worker on a raw ROUTER
socket sends the gateway frames no real worker would.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import httpx
import pytest
import zmq

from loomserve.gateway.text.tokenizer import Vocab
from loomserve.protocol import (
    PROTOCOL_VERSION,
    Accepted,
    Finish,
    Generate,
    Heartbeat,
    Hello,
    Load,
    ModelInfo,
    Outputs,
    Ping,
    TokenChunk,
    decode,
    encode,
)
from tests.conftest import LONG_CTX
from tests.procs import Proc, free_port, start_gateway, start_worker

CTX = LONG_CTX
# ignore_eos over most of a 16k context: about ten seconds on the tiny model.
LONG = {"prompt": "once upon a time", "max_tokens": CTX - 16, "ignore_eos": True}


def health(gateway: Proc) -> httpx.Response:
    return httpx.get(gateway.url + "/health", timeout=5)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until check() held; fails after timeout."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - started


def sse_events(lines: Iterator[str]) -> list[str]:
    """The data of every event left in a stream."""
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


# --- item 2: a tick that keeps failing ----------------------------------------------------


def test_one_failing_tick_fails_its_request_alone(tiny_model_path: Path) -> None:
    env = {"LOOMSERVE_TEST_FAIL_DECODE": "once"}
    with (
        start_worker(tiny_model_path, env=env, max_failed_ticks=2) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        url = gateway.url + "/v1/completions"
        poisoned = httpx.post(url, json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert poisoned.status_code == 500
        assert "internal error in the worker's tick" in poisoned.json()["error"]["message"]
        assert httpx.post(url, json={"prompt": "hi", "max_tokens": 4}, timeout=30).is_success
        assert health(gateway).status_code == 200 and worker.alive()


def test_ticks_failing_in_a_row_kill_the_worker_and_every_request_hears_of_it(
    tiny_model_path: Path,
) -> None:
    env = {"LOOMSERVE_TEST_FAIL_DECODE": "every"}
    with (
        start_worker(tiny_model_path, env=env, slots=1, max_failed_ticks=2) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        url = gateway.url + "/v1/completions"
        body = {"prompt": "hi", "max_tokens": 4, "stream": True}

        def stream() -> dict:
            """The error a streaming request ended with: its status, or its error event's."""
            with httpx.stream("POST", url, json=body, timeout=30) as response:
                if response.status_code != 200:
                    response.read()
                    return response.json()["error"]
                events = sse_events(response.iter_lines())
            assert events[-1] != "[DONE]"
            return json.loads(events[-1])["error"]

        # One slot: the first two fail in their ticks; the third waits in the queue and
        # hears that the engine died (or, when it came late, finds the worker gone: 503).
        with ThreadPoolExecutor(3) as pool:
            errors = list(pool.map(lambda _: stream(), range(3)))
        codes = sorted(error["code"] for error in errors)
        assert codes == ["internal_error", "internal_error", "worker_unavailable"], errors
        assert any("engine failed" in error["message"] for error in errors), errors
        assert worker.popen.wait(timeout=15) == 3  # for its supervisor to restart it
        unhealthy = health(gateway)
        assert unhealthy.status_code == 503 and unhealthy.headers["Retry-After"]


# --- item 3: SIGTERM drains ------------------------------------------------------------------


# The drain's timeout. Bounds here come from events and the work done, not the clock: the
# short stream needs SHORT_TOKENS batched steps and the long one ~CTX, so the short ends
# within the drain and the long one is cut at any machine speed where the long takes more
# than DRAIN_S (about ten seconds here, quiet) and SHORT_TOKENS less (400 times fewer steps).
DRAIN_S = 3
SHORT_TOKENS = 40


def test_sigterm_drains_the_gateway(long_model_path: Path) -> None:
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(long_model_path, slots=2, ctx_size=CTX))
        gateway = stack.enter_context(
            start_gateway(long_model_path, worker.endpoint, shutdown_timeout=DRAIN_S)
        )
        url = gateway.url + "/v1/completions"
        long = stack.enter_context(
            httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=30)
        )
        long_lines = long.iter_lines()
        assert next(long_lines).startswith("data: ")
        short_body = {**LONG, "max_tokens": SHORT_TOKENS, "stream": True}
        short = stack.enter_context(httpx.stream("POST", url, json=short_body, timeout=30))
        short_lines = short.iter_lines()
        assert next(short_lines).startswith("data: ")

        signalled = time.monotonic()
        gateway.popen.send_signal(signal.SIGTERM)
        # From its SIGTERM to its exit (DRAIN_S later, at least) the gateway answers 503: a
        # deadline well past that only matters if it never does.
        wait_until(lambda: health(gateway).status_code == 503, 30, "/health 503 while draining")
        refused = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert refused.json()["error"]["code"] == "shutting_down"

        assert sse_events(short_lines)[-1] == "[DONE]"  # finished within the drain
        cut = sse_events(long_lines)
        assert "shutting down" in json.loads(cut[-1])["error"]["message"]
        assert gateway.popen.wait(timeout=60) == 0
        # It waited the drain out for the long stream: a lower bound, which load only lengthens.
        assert time.monotonic() - signalled >= DRAIN_S
        assert "draining" in gateway.logs()


# --- item 4: a stalled gateway ------------------------------------------------------------------


def test_a_stopped_gateways_slots_are_freed_within_the_timeout(long_model_path: Path) -> None:
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(long_model_path, slots=1, ctx_size=CTX))
        observer = stack.enter_context(start_gateway(long_model_path, worker.endpoint))
        victim = stack.enter_context(
            start_gateway(long_model_path, worker.endpoint, heartbeat_interval=1.0)
        )
        stream = stack.enter_context(
            httpx.stream(
                "POST", victim.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30
            )
        )
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        idle = lambda: health(observer).json().get("slots_idle")  # noqa: E731
        wait_until(lambda: idle() == 0, 2, "the slot taken")
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            seconds = wait_until(lambda: idle() == 1, 10, "the stopped gateway's slot freed")
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        print(f"slot freed {seconds:.2f}s after its gateway stopped")
        assert seconds <= 3.5  # --gateway-timeout 3, checked every 0.3 s
        error = json.loads(sse_events(lines)[-1])["error"]
        assert "gateway" in error["message"] and "lost" in error["message"], error
        assert "worker at" not in error["message"]  # the worker is not to blame
        wait_until(lambda: health(victim).status_code == 200, 10, "the gateway back")


# --- item 5: a worker that sends bad frames ------------------------------------------------------


IDLE = Load(queue_depth=0, free_slots=1, running=0)  # the fake worker's one slot, always free


class FakeWorker:
    """A ROUTER socket that answers like a worker, and sends each request `script`'s chunks."""

    def __init__(self, model: Path, script: list[tuple[list[int], int]]) -> None:
        vocab = Vocab(model)
        self.info = ModelInfo(
            protocol_version=PROTOCOL_VERSION,
            model_name="fake",
            vocab_size=vocab.n_tokens,
            context_train=512,
            slot_context=512,
            slots=1,
            vocab_fingerprint=vocab.fingerprint(),
            ready=True,
        )
        vocab.close()
        self.script = script
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _send(self, gateway: bytes, message: object) -> None:
        self._socket.send_multipart([gateway, *encode(message)])

    def _run(self) -> None:
        gateways: set[bytes] = set()
        next_beat = 0.0
        while not self._stop.is_set():
            if self._socket.poll(50):
                gateway, *frames = self._socket.recv_multipart()
                message = decode(frames)
                gateways.add(gateway)
                if isinstance(message, Hello):
                    self._send(gateway, self.info)
                elif isinstance(message, Ping):
                    self._send(gateway, Heartbeat(time.time(), message.sent_at, True, IDLE))
                elif isinstance(message, Generate):
                    self._answer(gateway, message.request_id)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + 0.2
                for gateway in gateways:
                    self._send(gateway, Heartbeat(time.time(), 0.0, True, IDLE))

    def _answer(self, gateway: bytes, request_id: str) -> None:
        self._send(gateway, Accepted(request_id, 0))
        for tokens, seq in self.script:
            chunk = TokenChunk(request_id, tokens, seq=seq)
            self._send(gateway, Outputs(tokens=[chunk], finishes=[]))
        sent = sum(len(tokens) for tokens, _ in self.script)
        finish = Finish(request_id, "length", 3, sent, 0, 0.0)
        self._send(gateway, Outputs(tokens=[], finishes=[finish]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()


@contextmanager
def fake_worker(model: Path, script: list[tuple[list[int], int]]) -> Iterator[FakeWorker]:
    worker = FakeWorker(model, script)
    try:
        yield worker
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("script", "problem"),
    [
        ([([65], 0), ([66], 1), ([66], 1), ([67], 2)], "repeated"),  # "abbc"
        ([([67], 2), ([65], 0), ([66], 1)], "skipped"),  # "cab"
        ([([65], 0), ([10**9], 1)], "outside the vocabulary"),
        ([([65], 0), ([-5], 1)], "outside the vocabulary"),
    ],
)
def test_bad_token_frames_fail_their_request_and_nothing_else(
    tiny_model_path: Path, script: list[tuple[list[int], int]], problem: str
) -> None:
    with (
        fake_worker(tiny_model_path, script) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        url = gateway.url + "/v1/completions"
        answer = httpx.post(url, json={"prompt": "hi", "max_tokens": 8}, timeout=10)
        assert answer.status_code == 502, answer.text
        assert problem in answer.json()["error"]["message"]
        assert answer.json()["error"]["code"] == "bad_worker_output"
        with httpx.stream(
            "POST", url, json={"prompt": "hi", "max_tokens": 8, "stream": True}, timeout=10
        ) as response:
            events = sse_events(response.iter_lines())
        assert json.loads(events[-1])["error"]["code"] == "bad_worker_output"
        assert gateway.alive() and health(gateway).status_code == 200


def test_good_token_frames_from_the_fake_worker_make_text(tiny_model_path: Path) -> None:
    """The fake worker itself is sound: in sequence, its tokens become the text."""
    script = [([65], 0), ([66], 1), ([67], 2)]
    with (
        fake_worker(tiny_model_path, script) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        vocab = Vocab(tiny_model_path)
        expected = vocab.detokenize([65, 66, 67])
        vocab.close()
        answer = httpx.post(
            gateway.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=10
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == expected


# --- item 8: the HTTP edge --------------------------------------------------------------------


def open_sockets(proc: Proc) -> int:
    """The sockets among a process's descriptors (not the files and pipes it may open)."""
    fds = Path(f"/proc/{proc.pid}/fd")
    count = 0
    for fd in fds.iterdir():
        with suppress(FileNotFoundError):  # closed while we looked
            count += os.readlink(fd).startswith("socket:")
    return count


def closed_by_peer(socks: set[socket.socket]) -> list[socket.socket]:
    """The sockets whose other end has closed: readable, with nothing left to read."""
    readable, _, _ = select.select(list(socks), [], [], 0)
    return [sock for sock in readable if sock.recv(1) == b""]


def test_slow_headers_and_bodies_are_cut_off(tiny_model_path: Path) -> None:
    with (
        start_worker(tiny_model_path) as worker,
        start_gateway(
            tiny_model_path, worker.endpoint, header_timeout=1.0, body_timeout=1.0
        ) as gateway,
    ):
        host, port = gateway.url.removeprefix("http://").split(":")
        baseline = open_sockets(gateway)
        with ExitStack() as stack:
            socks = [
                stack.enter_context(socket.create_connection((host, int(port)), timeout=5))
                for _ in range(200)
            ]
            for index, sock in enumerate(socks):
                if index % 2:  # half say nothing, half start a request and stall
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            wait_until(lambda: open_sockets(gateway) >= baseline + 150, 5, "the connections open")
            # The gateway closes every one (each client reads the end of its stream)...
            still_open = set(socks)
            seconds = wait_until(
                lambda: (
                    not still_open.difference_update(closed_by_peer(still_open)) and not still_open
                ),
                10,
                "the gateway to close the slow connections",
            )
            # ...and lets their sockets go.
            wait_until(lambda: open_sockets(gateway) <= baseline + 5, 5, "their sockets freed")
        print(f"200 slow connections closed {seconds:.2f}s after they opened")

        sock = socket.create_connection((host, int(port)), timeout=10)
        with sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt":'
            )
            answer = sock.recv(65536).decode()
        assert answer.startswith("HTTP/1.1 408"), answer
        assert health(gateway).status_code == 200


def test_a_huge_token_id_body_does_not_stall_the_event_loop(tiny_model_path: Path) -> None:
    with (
        start_worker(tiny_model_path) as worker,
        start_gateway(tiny_model_path, worker.endpoint, max_body_bytes=16 * 2**20) as gateway,
    ):
        prompt = [100 + i % 400 for i in range(1_600_000)]
        body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
        assert len(body) > 7_800_000
        done = threading.Event()
        latencies: list[float] = []

        def probe() -> None:
            with httpx.Client(timeout=10) as client:
                while not done.is_set():
                    started = time.monotonic()
                    client.get(gateway.url + "/live")
                    latencies.append(time.monotonic() - started)
                    time.sleep(0.01)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            for _ in range(3):
                answer = httpx.post(
                    gateway.url + "/v1/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=60,
                )
                assert answer.status_code == 400
                assert answer.json()["error"]["code"] == "context_length_exceeded"
        finally:
            done.set()
            prober.join()
        print(f"/live during 3 bodies of 8 MB: max {max(latencies) * 1000:.0f} ms")
        # JSON parsing holds the GIL even in a thread: what is left is json.loads's time
        # (0.3 s alone on the 2-core test machine), far below the worker timeout.
        assert max(latencies) < 1.0
        assert health(gateway).status_code == 200 and "worker lost" not in gateway.logs()


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"top_k": 2**70}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"repeat_last_n": 2**40}, "repeat_last_n"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"temperature": "0.5"}, "temperature"),
        ({"seed": 2**70}, None),
        ({"max_tokens": 10_000}, "max_tokens"),  # beyond the context: not shortened
        ({"max_tokens": 2.5}, "max_tokens"),  # an integral float is an integer; 2.5 is not
        ({"n": 1.5}, "n"),
        ({"logprobs": 0.5}, "logprobs"),
        ({"prompt": [1, 2.5]}, "prompt"),
    ],
)
def test_strict_types_and_ranges(
    edge_gateway: Proc, change: dict[str, object], param: str | None
) -> None:
    body = {"prompt": "hello", "max_tokens": 4, **change}
    answer = httpx.post(edge_gateway.url + "/v1/completions", json=body, timeout=10)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_an_int_is_a_number(edge_gateway: Proc) -> None:
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0, "top_p": 1}
    assert httpx.post(edge_gateway.url + "/v1/completions", json=body, timeout=10).is_success


def test_an_integral_float_is_an_integer(edge_gateway: Proc) -> None:
    """JSON Schema (and vLLM, and pydantic's lax mode) count 2.0 as an integer: the answer is
    the one the integers get."""
    url = edge_gateway.url + "/v1/completions"
    ints = {"prompt": [1, 2, 3], "max_tokens": 3, "n": 2, "seed": 3, "logprobs": 2, "top_k": 5}
    floats = {"prompt": [1.0, 2, 3.0], "max_tokens": 3.0, "n": 2.0, "seed": 3.0}
    floats |= {"logprobs": 2.0, "top_k": 5.0}
    answers = [httpx.post(url, json=body, timeout=30) for body in (ints, floats)]
    assert all(answer.status_code == 200 for answer in answers), answers[1].text
    first, second = (answer.json() for answer in answers)
    # The same tokens and alternatives; the logprobs' last bits may differ after the first
    # request left the prompt cached (faults-audit-2.md, item 3).
    for one, other in zip(first["choices"], second["choices"], strict=True):
        assert one["text"] == other["text"] and one["finish_reason"] == other["finish_reason"]
        assert one["logprobs"]["tokens"] == other["logprobs"]["tokens"]
        tops = [top.keys() for top in one["logprobs"]["top_logprobs"]]
        assert tops == [top.keys() for top in other["logprobs"]["top_logprobs"]]
    assert first["usage"]["completion_tokens"] == second["usage"]["completion_tokens"]
    assert len(first["choices"]) == 2 and len(first["choices"][0]["logprobs"]["tokens"]) >= 1


def test_a_million_ids_with_one_bad_one_are_refused_at_once(edge_gateway: Proc) -> None:
    body = json.dumps({"prompt": [7] * 999_999 + [2.5], "max_tokens": 1}).encode()
    started = time.monotonic()
    answer = httpx.post(
        edge_gateway.url + "/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=120,
    )
    seconds = time.monotonic() - started
    print(f"refused in {seconds:.2f}s")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "prompt"
    assert seconds < 10  # an error per id took most of a minute


@pytest.fixture(scope="module")
def edge_gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        yield gateway


def test_a_queued_stream_the_worker_drops_gets_a_status_not_a_200(long_model_path: Path) -> None:
    with ExitStack() as stack:
        worker = stack.enter_context(
            start_worker(long_model_path, slots=1, ctx_size=CTX, shutdown_timeout=0)
        )
        gateway = stack.enter_context(start_gateway(long_model_path, worker.endpoint))
        url = gateway.url + "/v1/completions"
        running = stack.enter_context(
            httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=30)
        )
        running_lines = running.iter_lines()
        assert next(running_lines).startswith("data: ")
        with ThreadPoolExecutor(1) as pool:

            def queued() -> httpx.Response:
                with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=30) as r:
                    r.read()
                    return r

            answer = pool.submit(queued)
            wait_until(lambda: health(gateway).json().get("queue_depth") == 1, 10, "queued")
            worker.popen.send_signal(signal.SIGTERM)  # drains at once: both are cancelled
            response = answer.result(timeout=30)
        # The Finish saying "shutting down", or the closed connection, whichever lands first.
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "worker_unavailable"
        assert json.loads(sse_events(running_lines)[-1])["error"]["code"] == "worker_unavailable"
        assert worker.popen.wait(timeout=10) == 0
