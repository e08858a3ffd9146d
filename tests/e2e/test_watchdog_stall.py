"""A tick frozen by a debugger stop is still stuck (tick/watchdog.py), on a real worker process
and the tiny model.

The test stops only the worker's main thread, the one that runs the tick, as a debugger does
(ptrace: PTRACE_SEIZE and PTRACE_INTERRUPT stop one thread, where SIGSTOP stops them all,
the watchdog's too). The frozen tick uses no CPU, so its watchdog declares the engine dead and
the worker exits 3. A stop that catches the main thread holding the GIL freezes every Python
thread, the IO thread and the watchdog with it (a native call stuck that way would too): the
test sees that as an unanswered ping, lets the thread go and stops it again.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from loomserve.cli.health import probe
from tests.procs import Proc, start_gateway, start_worker

PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 17, 0x4206, 0x4207
WALL = 0x40000000  # waitpid's __WALL: a traced thread's stops
ATTEMPTS = 20


def _ptrace() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.ptrace
    call.restype = ctypes.c_long
    call.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    return call


class ThreadStop:
    """One thread of another process stopped as a debugger stops it, until released."""

    def __init__(self, tid: int) -> None:
        self.tid = tid
        self._ptrace = _ptrace()
        if self._ptrace(PTRACE_SEIZE, tid, None, None) != 0:
            code = ctypes.get_errno()
            if code in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                message = f"ptrace is not allowed here: {os.strerror(code)}"
                # CI (.ci/run) sets LOOMSERVE_REQUIRE_PTRACE: there it fails, not skips.
                if os.environ.get("LOOMSERVE_REQUIRE_PTRACE"):
                    pytest.fail(message)
                pytest.skip(message)
            raise OSError(code, os.strerror(code))
        assert self._ptrace(PTRACE_INTERRUPT, tid, None, None) == 0
        os.waitpid(tid, WALL)  # it has stopped

    def release(self) -> None:
        self._ptrace(PTRACE_DETACH, self.tid, None, None)  # it runs on


def keep_busy(gateway: Proc, done: threading.Event) -> None:
    """Streams back to back, so the worker is in a tick nearly all the time."""
    body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    for _ in range(200):
        if done.is_set():
            return
        try:
            httpx.post(gateway.url + "/v1/completions", json=body, timeout=30)
        except httpx.HTTPError:
            return  # the worker is gone


def test_a_tick_frozen_by_a_debugger_stop_is_declared_dead(tiny_model_path: Path) -> None:
    with (
        start_worker(tiny_model_path, tick_watchdog=1, threads=1) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        done = threading.Event()
        client = threading.Thread(target=keep_busy, args=(gateway, done), daemon=True)
        client.start()
        exited, stop = None, None
        try:
            for _ in range(ATTEMPTS):
                time.sleep(0.3)
                stop = ThreadStop(worker.pid)  # the main thread's id is the process's
                if probe(worker.endpoint, timeout=1.0).beat is None:
                    stop.release()  # stopped holding the GIL: nothing Python runs
                    continue
                # The IO thread answers, so the watchdog runs too; the tick is frozen.
                deadline = time.monotonic() + 15
                while exited is None and time.monotonic() < deadline:
                    exited = worker.popen.poll()
                    time.sleep(0.1)
                if exited is not None:
                    break
                stop.release()  # it was between ticks, where the watchdog does not look
            assert exited == 3, f"no frozen tick was declared dead in {ATTEMPTS} stops"
        finally:
            done.set()
            if exited is None and stop is not None:
                stop.release()  # a failing test leaves the worker to be stopped as ever
        logs = worker.logs()
        assert "tick stuck" in logs and "without using CPU" in logs
        client.join(timeout=30)
