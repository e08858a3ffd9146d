"""The tick watchdog: a worker whose tick is stuck says so, and exits to be restarted.

The tick loop runs on the main thread and most of a tick is spent in llama.cpp. A native call
that never returns (an ambiguous grammar whose parse stacks doubled per character did that)
freezes every stream on the worker, while the IO thread goes on answering heartbeats: the
gateways saw a ready worker and kept sending it requests, and SIGTERM did nothing, because
Python runs signal handlers on the main thread between bytecodes, which never came.

This thread watches the tick's start time. A tick running longer than the limit
(`--tick-watchdog`) marks the worker not ready, tells every gateway the engine is dead (they
fail its requests and answer /health 503), and ends the process with status 3 for its
supervisor to restart, as max_failed_ticks failures in a row do. SIGINT and SIGTERM reach it
through signal.set_wakeup_fd, whose byte the C-level handler writes even while the main
thread is stuck: after one, a tick that runs longer than the shutdown timeout ends the
process the same way, instead of waiting for the limit, and so does a loop still running
twice the shutdown timeout after it, wherever it is stuck.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

CHECKS_PER_LIMIT = 10  # how often the tick's age is looked at, per watchdog limit
MAX_CHECK_SECONDS = 1.0
STOP_SLACK = 1.0  # seconds past twice the shutdown timeout before a stopping worker is stuck


class Ticking(Protocol):
    """What the watchdog reads of the tick loop: when its current tick began, None between
    ticks and while it waits for work."""

    busy_since: float | None


class Watchdog:
    """A daemon thread that calls `on_stuck(why)` once, for a tick older than `limit` or one
    that outlives a stop signal by `stop_grace`; on_stuck is expected to end the process."""

    def __init__(
        self,
        loop: Ticking,
        limit: float,
        stop_grace: float,
        on_stuck: Callable[[str], None],
    ) -> None:
        self.loop = loop
        self.limit = limit
        self.stop_grace = stop_grace
        self.on_stuck = on_stuck
        self._stopping = threading.Event()
        self._signal_in, self._signal_out = socket.socketpair()
        self._signal_in.setblocking(False)
        self._signal_out.setblocking(False)
        self._previous_wakeup: int | None = None
        self._thread = threading.Thread(target=self._run, name="tick-watchdog", daemon=True)

    def start(self) -> None:
        """Watch from now on; on the main thread, stop signals are watched too."""
        with contextlib.suppress(ValueError):  # not the main thread: ticks only
            self._previous_wakeup = signal.set_wakeup_fd(
                self._signal_out.fileno(), warn_on_full_buffer=False
            )
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (the loop returned); gives the wakeup fd back."""
        self._stopping.set()
        if self._previous_wakeup is not None:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._previous_wakeup)
            self._previous_wakeup = None
        with contextlib.suppress(OSError):  # wake it now rather than at its next check
            self._signal_out.send(b"\0")
        if self._thread.is_alive():
            self._thread.join(timeout=2 * MAX_CHECK_SECONDS)
        self._signal_in.close()
        self._signal_out.close()

    def _run(self) -> None:
        interval = min(self.limit / CHECKS_PER_LIMIT, MAX_CHECK_SECONDS)
        signalled_at: float | None = None  # when SIGINT or SIGTERM came, if one did
        while not self._stopping.is_set():
            readable, _, _ = select.select([self._signal_in], [], [], interval)
            now = time.monotonic()
            if readable and self._signalled() and signalled_at is None:
                signalled_at = now
            # A stop signal ends the loop within the shutdown timeout (it cuts what is left
            # then). Still running long after, it is stuck, in a tick or between ticks: a
            # deadlock there once left a scaled-in worker up for good (channels.Inbox).
            if signalled_at is not None and now - signalled_at > 2 * self.stop_grace + STOP_SLACK:
                self._fire(f"asked to stop {now - signalled_at:.1f} s ago, and still running")
                return
            started = self.loop.busy_since
            if started is None:
                continue
            if now - started > self.limit:
                self._fire(f"a tick has run for {now - started:.1f} s (limit {self.limit:g} s)")
                return
            # Draining, ticks are as short as ever; one that outlives the grace is stuck.
            if signalled_at is not None and now - max(started, signalled_at) > self.stop_grace:
                self._fire(f"asked to stop, but a tick has run for {now - started:.1f} s")
                return

    def _signalled(self) -> bool:
        """Whether the bytes waiting are SIGINT or SIGTERM (others wake us too)."""
        try:
            data = self._signal_in.recv(64)
        except OSError:
            return False
        return any(sig in data for sig in (signal.SIGINT, signal.SIGTERM))

    def _fire(self, why: str) -> None:
        log.error("tick stuck: giving up on the engine", reason=why)
        if self._stopping.is_set():
            return
        self.on_stuck(why)


def exit_now(status: int) -> None:
    """End the process at once: the main thread is stuck in native code, so neither
    SystemExit nor atexit handlers can run."""
    os._exit(status)
