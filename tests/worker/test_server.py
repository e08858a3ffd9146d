"""The worker as a real process, spoken to over ZeroMQ with protocol frames, as a gateway would."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest
import zmq

from loomserve.gateway.text.tokenizer import Vocab
from loomserve.protocol import (
    PROTOCOL_VERSION,
    Accepted,
    Cancel,
    ErrorCode,
    Finish,
    Generate,
    Heartbeat,
    Hello,
    Load,
    Message,
    ModelInfo,
    Outputs,
    Ping,
    Rejected,
    SamplingParams,
    WorkerError,
    decode,
    encode,
)
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.tick.loop import TickLoop
from tests.procs import REPO_ROOT, Proc, Samples, free_port, scrape_metrics, start_worker

TIMEOUT = 20.0


class Gateway:
    """A DEALER socket with a gateway's identity, speaking protocol frames."""

    def __init__(self, endpoint: str, identity: str) -> None:
        self.identity = identity
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, message: Message) -> None:
        self.sock.send_multipart(encode(message))

    def send_raw(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float = TIMEOUT) -> Message | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return decode(self.sock.recv_multipart())

    def wait_for(self, predicate: Callable[[Message], bool], timeout: float = TIMEOUT) -> Message:
        """The first message that satisfies predicate, skipping the others."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            message = self.recv(left)
            if message is not None and predicate(message):
                return message
        raise AssertionError(f"{self.identity}: no matching message within {timeout}s")

    def hello(self) -> ModelInfo:
        self.send(Hello(self.identity))
        return self.wait_for(lambda m: isinstance(m, ModelInfo))

    def run(self, generate: Generate, timeout: float = TIMEOUT) -> tuple[list[int], Finish]:
        """Send one Generate and collect its tokens up to its Finish."""
        self.send(generate)
        tokens: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.recv(deadline - time.monotonic())
            if isinstance(message, Rejected) and message.request_id == generate.request_id:
                raise AssertionError(f"rejected: {message}")
            if isinstance(message, Outputs):
                for chunk in message.tokens:
                    if chunk.request_id == generate.request_id:
                        tokens += chunk.token_ids
                for finish in message.finishes:
                    if finish.request_id == generate.request_id:
                        return tokens, finish
        raise AssertionError(f"{generate.request_id} did not finish within {timeout}s")

    def close(self) -> None:
        self.sock.close(linger=0)


def greedy(request_id: str, prompt: list[int], max_tokens: int, **params) -> Generate:
    return Generate(
        request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    )


def is_finish_of(request_id: str) -> Callable[[Message], bool]:
    return lambda m: isinstance(m, Outputs) and any(f.request_id == request_id for f in m.finishes)


def finish_of(message: Outputs, request_id: str) -> Finish:
    return next(f for f in message.finishes if f.request_id == request_id)


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(tiny_model_path: Path, metrics_port: int) -> Iterator[Proc]:
    # The test gateways here never ping: a long gateway timeout keeps them known.
    with start_worker(
        tiny_model_path,
        slots=2,
        ctx_size=512,
        max_queue=4,
        metrics_port=metrics_port,
        gateway_timeout=60,
    ) as proc:
        yield proc


@pytest.fixture
def gateway(worker: Proc, request: pytest.FixtureRequest) -> Iterator[Gateway]:
    gw = Gateway(worker.endpoint, f"gw-{request.node.name}-{os.getpid()}")
    yield gw
    gw.close()


def test_hello_answers_model_info(gateway: Gateway, worker: Proc, tiny_model_path: Path):
    # The gateway's vocab-only copy must hash to what the worker announces.
    vocab = Vocab(tiny_model_path)
    try:
        fingerprint = vocab.fingerprint()
    finally:
        vocab.close()
    assert gateway.hello() == ModelInfo(
        protocol_version=PROTOCOL_VERSION,
        model_name="tiny-llama",  # the name it is served under: the file's stem by default
        vocab_size=544,
        context_train=1024,
        slot_context=512,
        slots=2,
        vocab_fingerprint=fingerprint,
        ready=True,
    )
    log = worker.log_path.read_text()
    assert '"event": "loading model"' in log and '"event": "model loaded"' in log
    # Its raw lines go through structlog: no line of llama.cpp's own on stderr.
    assert all(line.startswith("{") for line in log.splitlines() if line.strip()), log


def test_another_protocol_version_is_refused(gateway: Gateway):
    gateway.send(Hello(gateway.identity, protocol_version=PROTOCOL_VERSION + 1))
    error = gateway.wait_for(lambda m: isinstance(m, WorkerError))
    assert error.code == ErrorCode.PROTOCOL_MISMATCH


def test_generate_streams_the_same_tokens_as_the_in_process_loop(
    gateway: Gateway, tiny_model_path: Path
):
    gateway.hello()
    generate = greedy("r1", [1, 40, 41, 42], 12, ignore_eos=True)
    gateway.send(generate)
    accepted = gateway.wait_for(lambda m: isinstance(m, (Accepted, Rejected)))
    assert accepted == Accepted("r1", 0)
    tokens: list[int] = []
    while True:
        message = gateway.wait_for(lambda m: isinstance(m, Outputs))
        tokens += [t for chunk in message.tokens for t in chunk.token_ids]
        if message.finishes:
            break
    assert finish_of(message, "r1").reason == "length"
    assert finish_of(message, "r1").completion_tokens == 12

    engine = Engine(WorkerConfig(model_path=tiny_model_path, slots=2, ctx_size=512, threads=1))
    try:
        expected = _in_process(engine, generate)
    finally:
        engine.close()
    assert tokens == expected


def _in_process(engine: Engine, generate: Generate) -> list[int]:
    class Sink:
        def __init__(self) -> None:
            self.tokens: list[int] = []

        def send(self, gateway: bytes, message: Message) -> None:
            if isinstance(message, Outputs):
                self.tokens += [t for chunk in message.tokens for t in chunk.token_ids]

        def flush(self) -> None:
            pass

    sink = Sink()
    loop = TickLoop(engine, engine.config, sink)
    loop.inbox.submit(b"gw", generate)
    loop.tick()
    while loop.scheduler.has_work():
        loop.tick()
    return sink.tokens


def test_ping_is_answered_with_a_heartbeat(gateway: Gateway):
    gateway.hello()
    gateway.send(Ping(sent_at=1234.5))
    beat = gateway.wait_for(lambda m: isinstance(m, Heartbeat) and m.ping_sent_at == 1234.5)
    assert beat.ready and beat.load == Load(queue_depth=0, free_slots=2, running=0)


def test_worker_health_prints_the_load_of_the_heartbeat(worker: Proc) -> None:
    """`loomserve worker-health` decodes the worker's Heartbeat and prints its Load."""
    argv = [sys.executable, "-m", "loomserve.cli.main", "worker-health", "--worker"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMSERVE_")}
    result = subprocess.run(
        [*argv, worker.endpoint, "--timeout", str(TIMEOUT)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = re.fullmatch(r"ready: (\d+) running, (\d+) slots free, (\d+) queued\n", result.stdout)
    assert found is not None, result.stdout
    running, free, _queued = map(int, found.groups())
    assert running + free == 2  # the worker's two slots: each runs a request or is free


def test_a_probe_that_never_said_hello_is_answered_but_not_a_gateway(
    gateway: Gateway, metrics_port: int
):
    before = scrape(metrics_port)[("loomserve:gateways_connected", ())]
    gateway.send(Ping(sent_at=42.0))
    beat = gateway.wait_for(lambda m: isinstance(m, Heartbeat) and m.ping_sent_at == 42.0)
    assert beat.ready
    # Not one more: earlier tests' gateways, gone quiet, may drop out meanwhile (fewer), but a
    # probe counted as a gateway would add one.
    assert scrape(metrics_port)[("loomserve:gateways_connected", ())] <= before


def test_malformed_frames_are_dropped_and_the_worker_serves_on(gateway: Gateway, worker: Proc):
    gateway.hello()
    for frames in (
        [b"\x02"],  # no body
        [b"\x7f", msgpack.packb([])],  # unknown type
        [b"\x02", b"\xc1"],  # not msgpack
        [b"\x02", msgpack.packb(["r", "not tokens", []])],
        [b"\x02", msgpack.packb(["r", [], []])],  # an empty prompt
        [b"\x01", b"x", b"y"],  # three frames
        encode(Accepted("r", 0)),  # a message only workers send
    ):
        gateway.send_raw(frames)
    tokens, finish = gateway.run(greedy("after-garbage", [1, 7], 3))
    assert len(tokens) == 3 and finish.reason == "length"
    assert worker.alive()


def test_rejections_over_the_wire(gateway: Gateway):
    gateway.hello()
    limit = 512
    gateway.send(greedy("too-long", [1] * limit, 2))
    gateway.send(greedy("bad-token", [1, 10_000], 2))
    gateway.send(greedy("bad-grammar", [1], 2, grammar="root ::= ["))
    rejected = {}
    while len(rejected) < 3:
        message = gateway.wait_for(lambda m: isinstance(m, Rejected))
        rejected[message.request_id] = message.code
    assert rejected == {
        "too-long": "prompt_too_long",
        "bad-token": "invalid_request",
        "bad-grammar": "invalid_request",
    }


def test_queue_full_duplicates_and_cancellation(gateway: Gateway):
    gateway.hello()
    # Two slots and a queue of four: the seventh request in one burst finds no room.
    for i in range(7):
        gateway.send(greedy(f"q{i}", [1, 9 + i], 500, ignore_eos=True))
    gateway.send(greedy("q0", [1, 9], 5))  # q0 is live: a duplicate
    # Cancelled at once, not after the answers were read: on a busy machine the two running
    # requests could otherwise reach max_tokens before their Cancel (finish "length").
    for i in range(6):
        gateway.send(Cancel(f"q{i}"))
    answers: dict[str, Message] = {}
    duplicate = None
    while len(answers) < 7 or duplicate is None:
        message = gateway.wait_for(lambda m: isinstance(m, (Accepted, Rejected)))
        if message.request_id == "q0" and "q0" in answers:
            duplicate = message
        else:
            answers[message.request_id] = message
    assert [type(answers[f"q{i}"]).__name__ for i in range(7)] == ["Accepted"] * 6 + ["Rejected"]
    assert answers["q6"].code == "queue_full"
    assert duplicate.code == "duplicate_request"
    finishes = {}
    while len(finishes) < 6:
        message = gateway.wait_for(lambda m: isinstance(m, Outputs) and bool(m.finishes))
        finishes.update({f.request_id: f.reason for f in message.finishes})
    assert set(finishes.values()) == {"cancelled"}
    gateway.send(Ping(sent_at=1.0))
    beat = gateway.wait_for(lambda m: isinstance(m, Heartbeat) and m.ping_sent_at == 1.0)
    assert beat.load.free_slots == 2 and beat.load.queue_depth == 0


def test_a_request_the_gateway_ended_finishes_with_its_reason(
    gateway: Gateway, metrics_port: int
) -> None:
    """A gateway that matched a stop string cancels with reason stop: the worker's Finish
    and metrics say stop, as the client was told, and not cancelled (a client gone)."""
    gateway.hello()
    gateway.run(greedy("kept", [1, 30, 31], 5))  # its cells stay, for prefix reuse
    before = scrape(metrics_port)
    # Sent at once, not after a token came: on a busy machine the request could otherwise
    # reach max_tokens first. Queued or running when the Cancel comes, it ends with "stop".
    gateway.send(greedy("ended", [1, 40, 41], 400, ignore_eos=True))
    gateway.send(Cancel("ended", reason="stop"))
    finish = finish_of(gateway.wait_for(is_finish_of("ended")), "ended")
    assert finish.reason == "stop" and finish.completion_tokens < 400
    after = scrape(metrics_port)
    stopped = ("loomserve:requests_finished_total", (("finished_reason", "stop"),))
    assert after[stopped] - before.get(stopped, 0.0) == 1
    cancelled = ("loomserve:requests_cancelled_total", ())
    assert after[cancelled] == before.get(cancelled, 0.0)
    # Heartbeats carry the KV cache's cells, for the gateways' per-worker gauges (the first
    # request's cells, at least, are kept for prefix reuse): what the worker's gauge says.
    gateway.send(Ping(sent_at=2.0))
    beat = gateway.wait_for(lambda m: isinstance(m, Heartbeat) and m.ping_sent_at == 2.0)
    assert beat.kv_cells_total == 2 * 512
    assert 0 < beat.kv_cells_used == after[("loomserve:kv_cache_cells_used", ())]


def test_a_gateway_leaving_with_nothing_open_is_not_a_warning(worker: Proc) -> None:
    """A clean stop drains a gateway's streams before it goes: the worker notes it at info.
    One that leaves a request running is a warning, as it costs that request."""
    quiet = Gateway(worker.endpoint, f"gw-quiet-{os.getpid()}")
    quiet.hello()
    quiet.close()
    busy = Gateway(worker.endpoint, f"gw-busy-{os.getpid()}")
    busy.hello()
    busy.send(greedy("left-behind", [1, 50, 51], 500, ignore_eos=True))
    busy.wait_for(lambda m: isinstance(m, Outputs) and any(c.token_ids for c in m.tokens))
    busy.close()

    def lines_about(gateway: Gateway) -> list[dict]:
        """What the worker logged of the gateway leaving."""
        logged = [json.loads(line) for line in worker.logs().splitlines() if line.startswith("{")]
        return [
            line
            for line in logged
            if line.get("gateway") == gateway.identity
            and line["event"].startswith("gateway ")
            and line["event"] != "gateway connected"
        ]

    deadline = time.monotonic() + 30  # a heartbeat a second finds the quiet one gone
    while not (lines_about(quiet) and lines_about(busy)):
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.1)
    ((gone,), (lost,)) = lines_about(quiet), lines_about(busy)
    assert (gone["event"], gone["level"]) == ("gateway gone", "info")
    assert (lost["event"], lost["level"]) == ("gateway lost; cancelling its requests", "warning")
    assert lost["requests"] == 1


@contextmanager
def worker_process(model: Path, **config) -> Iterator[tuple[subprocess.Popen, str]]:
    """run_worker in a process of its own, with settings the CLI does not expose."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = ", ".join(f"{key}={value!r}" for key, value in config.items())
    script = (
        "from pathlib import Path\n"
        "from loomserve.cli.logs import configure_logging\n"
        "from loomserve.worker.config import WorkerConfig\n"
        "from loomserve.worker.server import run_worker\n"
        "configure_logging(json=True)\n"
        f"run_worker(WorkerConfig(Path({str(model)!r}), bind={endpoint!r}, {settings}))\n"
    )
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", script], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield proc, endpoint
        except BaseException:
            log.seek(0)
            print(log.read().decode(errors="replace")[-5000:], file=sys.stderr)
            raise
        finally:
            proc.terminate()
            proc.wait(timeout=TIMEOUT)


def test_a_silent_gateway_loses_its_requests(tiny_model_path: Path):
    with worker_process(
        tiny_model_path,
        slots=1,
        ctx_size=1024,
        max_queue=64,
        threads=1,
        heartbeat_interval=0.05,
        gateway_timeout=0.6,
    ) as (proc, endpoint):
        silent, watcher = Gateway(endpoint, "silent"), Gateway(endpoint, "watcher")
        try:
            silent.hello()
            watcher.hello()
            # About 60 x 1000 tokens of work: far longer than the timeout.
            for i in range(60):
                silent.send(greedy(f"s{i}", [1, 5], 1000, ignore_eos=True))
            watcher.wait_for(lambda m: isinstance(m, Heartbeat) and m.load.free_slots == 0)
            went_silent = time.monotonic()
            # The watcher keeps talking; the silent gateway says nothing from here on.
            deadline = went_silent + TIMEOUT
            while time.monotonic() < deadline:
                watcher.send(Ping(time.time()))
                beat = watcher.wait_for(lambda m: isinstance(m, Heartbeat))
                if beat.load.free_slots == 1 and beat.load.queue_depth == 0:
                    break
            else:
                raise AssertionError("the silent gateway's requests were never cancelled")
            assert time.monotonic() - went_silent < 10
            # Its requests each finished once, most of them cancelled; it must say Hello again.
            reasons = {}
            while (message := silent.recv(timeout=0.5)) is not None:
                if isinstance(message, Outputs):
                    reasons.update({f.request_id: f.reason for f in message.finishes})
            assert len(reasons) == 60 and set(reasons.values()) <= {"length", "cancelled"}
            assert list(reasons.values()).count("cancelled") >= 50
            silent.send(Ping(time.time()))
            error = silent.wait_for(lambda m: isinstance(m, WorkerError))
            assert error.code == ErrorCode.GATEWAY_LOST
            assert silent.hello().ready
            tokens, _ = silent.run(greedy("back", [1, 5], 3))
            assert len(tokens) == 3
            assert proc.poll() is None
        finally:
            silent.close()
            watcher.close()


def test_sigterm_cancels_live_requests_and_exits_cleanly(tiny_model_path: Path):
    with start_worker(
        tiny_model_path, slots=1, ctx_size=1024, max_queue=8, shutdown_timeout=0.2
    ) as proc:
        gateway = Gateway(proc.endpoint, "gw-sigterm")
        try:
            gateway.hello()
            # Eight requests of a whole slot context each: seconds of work.
            for i in range(8):
                gateway.send(greedy(f"r{i}", [1, 5], 100_000, ignore_eos=True))
            gateway.wait_for(lambda m: isinstance(m, Outputs) and bool(m.tokens))
            proc.popen.send_signal(signal.SIGTERM)
            assert proc.popen.wait(timeout=TIMEOUT) == 0
            reasons = {}
            while (message := gateway.recv(timeout=1.0)) is not None:
                if isinstance(message, Outputs):
                    reasons.update({f.request_id: f.reason for f in message.finishes})
            # Every request finished exactly once; those still live after the drain, cancelled.
            assert set(reasons) == {f"r{i}" for i in range(8)}
            assert set(reasons.values()) <= {"length", "cancelled"}
            assert reasons["r7"] == "cancelled"
        finally:
            gateway.close()


def scrape(port: int) -> Samples:
    return scrape_metrics(f"http://127.0.0.1:{port}/metrics")


def test_metrics_count_what_the_worker_did(gateway: Gateway, metrics_port: int):
    gateway.hello()
    before = scrape(metrics_port)
    # No earlier request started with these tokens, so nothing of it is cached.
    tokens, finish = gateway.run(greedy("m1", [300, 301, 302, 303, 304], 7, ignore_eos=True))
    assert len(tokens) == 7 and finish.cached_tokens == 0
    gateway.send(greedy("m-too-long", [1] * 600, 2))
    gateway.wait_for(lambda m: isinstance(m, Rejected))
    after = scrape(metrics_port)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)

    assert delta("loomserve:generation_tokens_total") == 7
    assert delta("loomserve:prompt_tokens_total") == 5
    assert delta("loomserve:requests_finished_total", finished_reason="length") == 1
    assert delta("loomserve:requests_rejected_total", reason="prompt_too_long") == 1
    assert delta("loomserve:prefix_cache_queries_total") == 5
    assert delta("loomserve:batch_tokens_total", kind="prefill") == 5
    assert delta("loomserve:batch_tokens_total", kind="decode") == 6
    assert delta("loomserve:tick_duration_seconds_count") == 7
    assert after[("loomserve:kv_cache_cells_total", ())] == 2 * 512
    assert after[("loomserve:free_slots", ())] == 2
    assert after[("loomserve:num_requests_running", ())] == 0
    assert after[("loomserve:kv_cache_cells_used", ())] >= 11  # kept for prefix reuse
    assert after[("loomserve:gateways_connected", ())] >= 1
    # The 600-token prompt is refused while it is decoded (more ids than a context holds):
    # its Rejected says prompt_too_long, and the frame counts as one dropped as malformed.
    assert delta("loomserve:messages_dropped_total", reason="malformed") == 1
