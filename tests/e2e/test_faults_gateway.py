"""Faults at the gateway found by the second audit (docs/faults-audit-2.md): a worker lost before a
request's first token, CURVE keys that do not match, a client that does not read its stream.

Real worker and gateway processes on the tiny model (tests/procs.py).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import jsonschema
import pytest

from loomserve.cli.keygen import ensure_certificates
from tests.conftest import LONG_CTX
from tests.procs import REPO_ROOT, Proc, scrape_metrics, start_gateway, start_worker

CTX = LONG_CTX
# ignore_eos over most of a 16k context: about ten seconds on the tiny model.
LONG = {"prompt": "once upon a time", "max_tokens": CTX - 16, "ignore_eos": True}


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


def routed(gateway: Proc) -> dict[str, float]:
    """Requests the gateway routed to each worker so far."""
    samples = scrape_metrics(gateway.url + "/metrics")
    return {
        dict(labels)["worker"]: value
        for (name, labels), value in samples.items()
        if name == "loomserve:worker_requests_routed_total"
    }


def idle_slots(gateway: Proc) -> int | None:
    return httpx.get(gateway.url + "/health", timeout=5).json().get("slots_idle")


def rerouted(gateway: Proc, reason: str) -> float:
    samples = scrape_metrics(gateway.url + "/metrics")
    return samples.get(("loomserve:requests_rerouted_total", (("reason", reason),)), 0.0)


# --- item 2: a worker lost before the first token ---------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_queued_on_a_killed_worker_is_served_by_the_other(
    long_model_path: Path, stream: bool
) -> None:
    """Two workers of one slot each, both busy with a long stream; a third request waits in
    one's queue. That worker is killed: the waiting request goes to the other worker and is
    answered in full, as it would have been alone."""
    short = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0}
    with ExitStack() as stack:
        workers = [
            stack.enter_context(start_worker(long_model_path, slots=1, ctx_size=CTX))
            for _ in range(2)
        ]
        # The long streams are left unread for seconds: room for all their tokens, or the
        # gateway may cancel them as slow readers (see the slow reader's test below).
        endpoints = [w.endpoint for w in workers]
        gateway = stack.enter_context(
            start_gateway(long_model_path, endpoints, stream_buffer_tokens=CTX)
        )
        url = gateway.url + "/v1/completions"
        alone = httpx.post(url, json=short, timeout=30)
        assert alone.status_code == 200, alone.text

        # One long stream on each worker: each waits for the heartbeats to show the slots
        # as they are (a stale one would make a busy worker look as free as an idle one).
        longs: dict[str, tuple[httpx.Response, Iterator[str]]] = {}
        for busy in range(2):
            wait_until(lambda b=busy: idle_slots(gateway) == 2 - b, 10, "heartbeats")
            before = routed(gateway)
            response = stack.enter_context(
                httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60)
            )
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            (target,) = [w for w, n in routed(gateway).items() if n > before.get(w, 0)]
            longs[target] = (response, lines)
        assert len(longs) == 2, "the two long streams went to the same worker"
        wait_until(lambda: idle_slots(gateway) == 0, 10, "both slots busy")
        before = routed(gateway)

        def queued() -> tuple[int, str]:
            body = {**short, "stream": stream}
            with httpx.stream("POST", url, json=body, timeout=60) as response:
                response.read()
                return response.status_code, response.text

        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(queued)
            wait_until(lambda: sum(routed(gateway).values()) > sum(before.values()), 10, "routed")
            after = routed(gateway)
            (target,) = [w for w in after if after[w] > before.get(w, 0)]
            victim = next(w for w in workers if w.endpoint == target)
            survivor = next(w for w in workers if w.endpoint != target)
            victim.kill()
            # The victim's own long stream ends with an error: it had output already.
            events = sse_events(longs[victim.endpoint][1])
            assert json.loads(events[-1])["error"]["code"] == "worker_unavailable"
            # The survivor frees its slot once its long stream's client leaves.
            longs[survivor.endpoint][0].close()
            status, text = answer.result(timeout=60)
        assert status == 200, text
        if stream:
            events = sse_events(iter(text.splitlines()))
            assert events[-1] == "[DONE]"
            got = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        else:
            got = json.loads(text)["choices"][0]["text"]
        assert got == alone.json()["choices"][0]["text"]
        assert rerouted(gateway, "lost") == 1
        assert "sent to another worker" in gateway.logs()


# --- item 5: CURVE handshakes that fail ----------------------------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    ensure_certificates(tmp_path / "keys", ["worker", "gateway", "stranger"])
    return tmp_path / "keys"


def unhealthy_because(gateway: Proc, timeout: float = 60.0) -> str:
    """The message of the gateway's 503, once it says more than "not connected"."""
    message = ""

    def told() -> bool:
        nonlocal message
        answer = httpx.get(gateway.url + "/health", timeout=5)
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        return "cannot connect" in message

    wait_until(told, timeout, f"a reason from {gateway.name}: {message}")
    return message


def test_curve_handshake_failures_are_named_on_both_sides(
    tiny_model_path: Path, keys: Path
) -> None:
    with ExitStack() as stack:
        worker = stack.enter_context(
            start_worker(
                tiny_model_path,
                wait=False,
                curve_secret_key_file=keys / "worker.key_secret",
                curve_allowed_keys=keys / "gateway.key",
            )
        )
        wrong_keys = {
            # A server key that is not the worker's: it cannot decrypt our HELLO.
            "server key": (keys / "stranger.key", keys / "gateway.key_secret"),
            # The worker's key, but our own is not in its allow-list.
            "own key": (keys / "worker.key", keys / "stranger.key_secret"),
            "no keys": (None, None),
        }
        gateways = {
            name: stack.enter_context(
                start_gateway(
                    tiny_model_path,
                    worker.endpoint,
                    wait=False,
                    curve_server_key_file=server,
                    curve_secret_key_file=secret,
                )
            )
            for name, (server, secret) in wrong_keys.items()
        }
        for gateway in gateways.values():
            wait_until(gateway_listens(gateway), 60, "the gateway listening")
        server_key = unhealthy_because(gateways["server key"])
        assert "--curve-server-key-file is not that worker's public key" in server_key
        own_key = unhealthy_because(gateways["own key"])
        assert "not in the worker's --curve-allowed-keys" in own_key
        assert "requires CURVE" in unhealthy_because(gateways["no keys"])
        answer = httpx.post(
            gateways["server key"].url + "/v1/completions", json={"prompt": "hi"}, timeout=60
        )
        assert answer.status_code == 503 and answer.json()["error"]["message"] == server_key
        # Each side logs what it saw when it saw it: wait for the line (a busy machine may
        # write it after the other side's), never assume it is there already.
        for gateway in gateways.values():
            logged(gateway, lambda logs: "handshake with the worker failed" in logs)
        logged(worker, lambda logs: "does not hold this worker's public key" in logs)
        # The plain gateway: libzmq tells whichever end sees the mismatch first.
        logged(
            worker,
            lambda logs: "connected without CURVE" in logs or "a client without CURVE keys" in logs,
        )
        # The allow-list's own word on the stranger.
        logged(worker, lambda logs: "not in the allow-list" in logs)

        # worker-health says the same, and exits 1.
        probe = run_cli(
            "worker-health",
            "--worker",
            worker.endpoint,
            "--timeout",
            "10",  # it waits all of it; the handshake fails in milliseconds, even when busy
            "--curve-server-key-file",
            str(keys / "stranger.key"),
            "--curve-secret-key-file",
            str(keys / "gateway.key_secret"),
        )
        assert probe.returncode == 1
        assert "--curve-server-key-file is not that worker's public key" in probe.stderr

        # With the right keys all is well: the checks above can tell.
        good = stack.enter_context(
            start_gateway(
                tiny_model_path,
                worker.endpoint,
                curve_server_key_file=keys / "worker.key",
                curve_secret_key_file=keys / "gateway.key_secret",
            )
        )
        body = {"prompt": "hi", "max_tokens": 2}
        answer = httpx.post(good.url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert "handshake with the worker failed" not in good.logs()


def logged(proc: Proc, check: Callable[[str], bool], timeout: float = 60.0) -> None:
    """Wait until proc's log passes check (on a failure, Proc's exit prints the log's tail)."""
    wait_until(lambda: check(proc.logs()), timeout, f"the line in the {proc.name}'s log")


def gateway_listens(gateway: Proc) -> Callable[[], bool]:
    def check() -> bool:
        assert gateway.alive(), gateway.log_tail()
        try:
            httpx.get(gateway.url + "/live", timeout=2)
        except httpx.HTTPError:
            return False
        return True

    return check


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomserve.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )


# --- item 6: a client that does not read its stream -------------------------------------------


def test_a_client_that_does_not_read_loses_its_slot_not_the_gateways_memory(
    long_model_path: Path,
) -> None:
    """The client sends a long streaming request and reads nothing: once its connection is
    full, at most --stream-buffer-tokens wait in the gateway, then the request is cancelled
    in the worker (before it would end). A reader that keeps up gets every token.

    What is measured does not depend on the machine's load: the tokens the gateway held when
    it gave up (its memory), and that the request was cut. How many more the worker made
    before the Cancel reached it does (a starved gateway is slow to send it), and so does
    every wait: those are generous, to catch a hang, not to time anything."""
    with ExitStack() as stack:
        worker = stack.enter_context(start_worker(long_model_path, slots=1, ctx_size=CTX))
        gateway = stack.enter_context(
            start_gateway(long_model_path, worker.endpoint, stream_buffer_tokens=1024)
        )
        host, port = gateway.url.removeprefix("http://").split(":")
        # With 20 alternatives per token each event is over a kilobyte: the kernel's buffers
        # (4 MiB on loopback) fill within a few thousand tokens, then the gateway's.
        body = json.dumps({**LONG, "stream": True, "logprobs": 20}).encode()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stack.callback(sock.close)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        sock.connect((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )

        def finished() -> list[dict]:
            lines = worker.logs().splitlines()
            return [json.loads(line) for line in lines if "request finished" in line]

        seconds = wait_until(lambda: len(finished()) == 1, 300, "the request to end")
        (record,) = finished()
        print(f"cancelled after {seconds:.2f}s and {record['completion_tokens']} tokens")
        assert record["reason"] == "cancelled"
        assert record["completion_tokens"] < LONG["max_tokens"], record
        event = "client reads too slowly; request cancelled"
        lines = [json.loads(line) for line in gateway.logs().splitlines() if event in line]
        (gave_up,) = lines
        # One tick's tokens over the limit at most (one, or a verified draft's few).
        assert 1024 < gave_up["buffered_tokens"] <= 1024 + 17, gave_up
        wait_until(lambda: idle_slots(gateway) == 1, 60, "the slot free")

        # What the client reads at last: the tokens it was owed, then the error event. A
        # bigger buffer now, and acks at once: through the 4 KiB window the connection was
        # made with, megabytes of backlog took minutes of delayed acks on a busy machine.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        if hasattr(socket, "TCP_QUICKACK"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        sock.settimeout(60)
        received, deadline = bytearray(), time.monotonic() + 300
        while (chunk := sock.recv(1 << 20)) and time.monotonic() < deadline:
            tail = bytes(received[-32:]) + chunk  # a marker may straddle two reads
            received += chunk
            if b"reader_too_slow" in tail or b"[DONE]" in tail:
                break
        assert b"reader_too_slow" in received and b"[DONE]" not in received

        # A reader that keeps up is never cut, however long its stream.
        whole = {**LONG, "max_tokens": 3000, "stream": True}
        whole["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", gateway.url + "/v1/completions", json=whole, timeout=60) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 3000


# --- item 6: requests the schema allows but the gateway refuses -------------------------------

# Found by schemathesis in positive mode (bodies generated to fit /openapi.json): each got a
# 400 while its schema said it was valid. The schema now says what the checks say.
REFUSED = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "n": 0}),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.9e16}),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}),
    ("/v1/completions", {"prompt": "hi", "repeat_penalty": 0}),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 3.1e25}),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_obfuscation": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "modalities": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "audio": {}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
    ),
    # What the model does not decide (faults-audit-2.md, "Schema-valid requests that got 400").
    ("/v1/completions", {"prompt": "hi", "top_logprobs": 2}),  # chat's; completions: logprobs
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": [[1], []]}),
    ("/v1/completions", {"prompt": [-1]}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}),
    (
        "/v1/completions",
        {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
    ),
    ("/v1/completions", {"prompt": "hi", "n": 1.5}),  # not an integer, for JSON Schema either
]
# Integral floats are integers for JSON Schema, and for the gateway now too.
ACCEPTED = [
    ("/v1/completions", {"prompt": [1.0, 2], "max_tokens": 2.0, "n": 2.0, "seed": 3.0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logprobs": 2.0, "top_k": 8381.0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {"5": 1.5}}),
    (
        "/v1/completions",
        {
            "prompt": "hi",
            "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {}}},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 1.0,
            "logprobs": True,
            "top_logprobs": 2.0,
        },
    ),
]


def test_the_schema_refuses_what_the_gateway_refuses(tiny_model_path: Path) -> None:
    with (
        start_worker(tiny_model_path) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        document = httpx.get(gateway.url + "/openapi.json", timeout=10).json()

        def validator(path: str) -> jsonschema.Validator:
            body = document["paths"][path]["post"]["requestBody"]["content"]
            schema = {**body["application/json"]["schema"], "components": document["components"]}
            return jsonschema.Draft202012Validator(schema)

        for path, body in REFUSED:
            answer = httpx.post(gateway.url + path, json=body, timeout=30)
            assert answer.status_code == 400, (path, body, answer.text)
            assert not validator(path).is_valid(body), (path, body, "the schema allows it")
        for path, body in ACCEPTED:
            assert validator(path).is_valid(body), (path, body)
            answer = httpx.post(gateway.url + path, json=body, timeout=30)
            assert answer.status_code == 200, (path, body, answer.text)
        # The checks can tell: the same bodies made valid pass both.
        fine = {"prompt": "hi", "max_tokens": 2, "n": 1, "temperature": 0.5, "top_p": 1}
        assert validator("/v1/completions").is_valid(fine)
        assert httpx.post(gateway.url + "/v1/completions", json=fine, timeout=30).is_success
        chat = {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text"]}
        assert validator("/v1/chat/completions").is_valid({**chat, "max_completion_tokens": 2})
        answer = httpx.post(gateway.url + "/v1/chat/completions", json={**chat, "max_tokens": 2})
        assert answer.is_success, answer.text
