"""Start worker and gateway processes on free loopback ports for end-to-end tests.

    with start_worker(model, slots=2) as worker, start_gateway(model, worker.endpoint) as gw:
        httpx.get(gw.url + "/health")

Each process logs to a file; the log's tail is printed when a `with` block fails or when a
process does not become ready, so pytest shows it with the failure. Options are passed as
CLI flags: `ctx_size=256` -> `--ctx-size 256`, `log_json=False` -> `--no-log-json`.

The processes run in sessions of their own (a terminal's Ctrl-C is for pytest, which then
stops them in order); whatever is still running when the test process exits, Ctrl-C'd
mid-start included, is killed then, so an interrupted run leaves no server behind.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from loomserve.protocol.codec import decode, encode
from loomserve.protocol.messages import Hello, ModelInfo

REPO_ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = Path(tempfile.gettempdir()) / "loomserve-test-logs"
START_TIMEOUT = 60.0

# Prometheus samples keyed by metric name and sorted labels.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# Every port free_port has handed out in this test run.
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, and that this run has not
    handed out before. A process binds its port only once it has started, and meanwhile the
    kernel may give the same free port out again: two of three gateways started at once could
    share one (the second fails to bind), and a test read one's health at the other's
    address (the likeliest cause of a CURVE test's rare "requires CURVE" from the gateway
    that had keys)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def scrape_metrics(url: str) -> Samples:
    """Every sample a Prometheus endpoint serves right now."""
    text = httpx.get(url, timeout=5.0).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# Every Proc started in this process and not yet reaped: killed at exit (kill_leftovers),
# and at the end of a pytest session (tests/conftest.py).
_RUNNING: set[Proc] = set()


def kill_leftovers() -> None:
    """SIGKILL what a test left running: at once, so a second Ctrl-C finds nothing to wait for."""
    for proc in list(_RUNNING):
        with contextlib.suppress(OSError):
            proc.popen.kill()
        _RUNNING.discard(proc)


atexit.register(kill_leftovers)


class Proc:
    """A loomserve process: its command, its log file, and how to stop it."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.args = args
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("wb")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "loomserve.cli.main", *args],
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # our signals only, not the terminal's
        )
        _RUNNING.add(self)
        self.url = ""  # http://127.0.0.1:PORT for gateways
        self.endpoint = ""  # tcp://127.0.0.1:PORT for workers

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def logs(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        tail = "\n".join(self.logs().splitlines()[-lines:])
        return f"--- {self.name} (pid {self.pid}) log, {self.log_path} ---\n{tail}\n"

    def kill(self) -> None:
        """SIGKILL and reap: the process gets no chance to clean up."""
        if self.alive():
            self.popen.kill()
        self.popen.wait()
        _RUNNING.discard(self)

    def stop(self, timeout: float = 5.0) -> int:
        """SIGTERM, then SIGKILL if it has not exited within timeout; the exit status."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        code = self.popen.wait()
        _RUNNING.discard(self)
        self._log.close()
        return code

    def fail(self, message: str) -> None:
        """Raise with the log's tail attached."""
        raise RuntimeError(f"{message}\n{self.log_tail()}")

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            print(self.log_tail(), file=sys.stderr)
        self.stop()


def cli_flags(options: dict[str, Any]) -> list[str]:
    """Keyword options as CLI flags; None leaves an option out, lists repeat it."""
    flags: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            for item in value:
                flags += [flag, str(item)]
        else:
            flags += [flag, str(value)]
    return flags


def start_worker(
    model: Path,
    port: int | None = None,
    wait: bool = True,
    env: dict[str, str] | None = None,
    **options: Any,
) -> Proc:
    """A worker on tcp://127.0.0.1:port (a free one by default), ready unless wait=False."""
    port = port or free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    options = {"slots": 4, "ctx_size": 512, "threads": 1, **options}
    args = ["worker", "--model", str(model), "--bind", endpoint, *cli_flags(options)]
    proc = Proc("worker", args, env)
    proc.endpoint = endpoint
    if wait:
        _started(proc, lambda: wait_worker_ready(proc))
    return proc


def start_gateway(
    model: Path | None,
    worker_endpoint: str | list[str],
    port: int | None = None,
    wait: bool = True,
    env: dict[str, str] | None = None,
    **options: Any,
) -> Proc:
    """A gateway on http://127.0.0.1:port (to one worker, or to each of a list of workers);
    with wait, until /health says 200. model None: no --model, the gateway learns each
    worker's model from the worker (model=[...] in options gives NAME=PATH ones)."""
    port = port or free_port()
    options = {"worker_timeout": 2.0, "heartbeat_interval": 0.25, **options}
    endpoints = [worker_endpoint] if isinstance(worker_endpoint, str) else worker_endpoint
    args = [
        "gateway",
        *(["--model", str(model)] if model is not None else []),
        *cli_flags({"worker": endpoints}),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *cli_flags(options),
    ]
    proc = Proc("gateway", args, env)
    proc.url = f"http://127.0.0.1:{port}"
    if wait:
        _started(proc, lambda: wait_http(proc, "/health"))
    return proc


def _started(proc: Proc, wait: Callable[[], object]) -> None:
    """wait() for proc to be ready; if it fails or is interrupted (Ctrl-C), kill proc: no
    caller's `with` holds it yet."""
    try:
        wait()
    except BaseException:
        proc.kill()
        raise


def wait_http(proc: Proc, path: str, status: int = 200, timeout: float = START_TIMEOUT) -> None:
    """Poll GET proc.url + path until it answers status."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if not proc.alive():
            proc.fail(f"{proc.name} exited with {proc.popen.returncode} before {path} was {status}")
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(proc.url + path, timeout=2.0)
            if response.status_code == status:
                return
            last = f"{response.status_code} {response.text[:200]}"
        time.sleep(0.05)
    proc.fail(f"{proc.name}: {path} did not answer {status} within {timeout}s (last: {last})")


def wait_worker_ready(proc: Proc, timeout: float = START_TIMEOUT) -> ModelInfo:
    """Say Hello over the protocol until the worker answers a ready ModelInfo."""
    context = zmq.Context.instance()
    deadline = time.monotonic() + timeout
    with context.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"probe-{os.getpid()}-{time.monotonic_ns()}".encode())
        sock.connect(proc.endpoint)
        while time.monotonic() < deadline:
            if not proc.alive():
                proc.fail(f"worker exited with {proc.popen.returncode} before it was ready")
            sock.send_multipart(encode(Hello(gateway_id="test-probe")))
            if sock.poll(250):
                message = decode(sock.recv_multipart())
                if isinstance(message, ModelInfo) and message.ready:
                    return message
    proc.fail(f"worker at {proc.endpoint} not ready within {timeout}s")
    raise AssertionError("unreachable")


# --- other servers (llama.cpp's llama-server, llama-cpp-python's), for oracles and the bench --

LLAMA_SERVER_ENV = "LOOMSERVE_LLAMA_SERVER"
OTHER_SERVER_TIMEOUT = 90.0


def llama_server_binary() -> str:
    """The llama-server binary LOOMSERVE_LLAMA_SERVER names. Unset, the test skips, unless
    LOOMSERVE_REQUIRE_LLAMA_SERVER says it must run (CI builds the binary and sets both)."""
    binary = os.environ.get(LLAMA_SERVER_ENV)
    if not binary:
        message = (
            f"{LLAMA_SERVER_ENV} is not set: name a llama-server binary (.ci/build-llama-server)"
        )
        if os.environ.get("LOOMSERVE_REQUIRE_LLAMA_SERVER"):
            pytest.fail(message)
        pytest.skip(message)
    if not Path(binary).is_file():
        pytest.fail(f"{LLAMA_SERVER_ENV}={binary}: no such file")
    return binary


def start_other_server(args: list[str], port: int, name: str) -> tuple[subprocess.Popen, Path]:
    """Another server's process in a session of its own, logging to a file, once its
    /v1/models answers (the test fails with the log's tail otherwise)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"{name}-{os.getpid()}-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + OTHER_SERVER_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2.0).status_code == 200:
                return proc, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_other_server(proc)
    pytest.fail(f"{name} not ready within {OTHER_SERVER_TIMEOUT} s:\n{log.read_text()[-3000:]}")


def stop_other_server(proc: subprocess.Popen) -> None:
    """SIGTERM its session (the server and nothing else), SIGKILL after 15 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
