"""The tick watchdog: a worker whose tick is stuck says so, and exits to be restarted.

The tick loop runs on the main thread and most of a tick is spent in llama.cpp. A native call
that never returns (an ambiguous grammar whose parse stacks doubled per character did that)
freezes every stream on the worker, while the IO thread goes on answering heartbeats: the
gateways saw a ready worker and kept sending it requests, and SIGTERM did nothing, because
Python runs signal handlers on the main thread between bytecodes, which never came.

This thread watches the tick's start time and the CPU time the process has used since. A
tick that has run longer than the limit (`--tick-watchdog`) and used (almost) no CPU over the
last limit's worth of seconds is stuck: it waits on something that will not come (a lock, a
frozen thread). Then the worker is marked not ready, every gateway is told the engine is dead
(they fail its requests and answer /health 503), and the process ends with status 3 for its
supervisor to restart, as max_failed_ticks failures in a row do. A tick that goes on using
CPU is slow, not stuck: on a starved host (a busy laptop, a pod at its CPU limit, a load of
20) one pass can take minutes, and restarting the worker would only throw its work away and
load the model again on the same starved CPUs. It may run HARD_LIMIT_FACTOR limits in all.

CPU time cannot tell every stall from progress: a native loop that never ends (an ambiguous
grammar without its bound did that) uses CPU as a slow pass does, and so do llama.cpp's
threads that spin at one of ggml's barriers for a thread that was frozen; the hard limit ends
those. SIGINT and SIGTERM reach the watchdog through signal.set_wakeup_fd, whose byte the
C-level handler writes even while the main thread is stuck: after one, a tick that runs
longer than the shutdown timeout ends the process the same way, instead of waiting for the
limit, and so does a loop still running twice the shutdown timeout after it, wherever it is
stuck.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

log = structlog.get_logger(__name__)

CHECKS_PER_LIMIT = 10  # how often the tick's age is looked at, per watchdog limit
MAX_CHECK_SECONDS = 1.0
STOP_SLACK = 1.0  # seconds past twice the shutdown timeout before a stopping worker is stuck
# A tick that keeps using CPU may run this many limits (10: 300 s at the default 30 s).
HARD_LIMIT_FACTOR = 10.0
# CPU-seconds per second over the last limit below which a tick makes no progress: 2 % of a
# core. An idle worker's own threads (the IO thread, heartbeats, this one) used 0.6 % with a
# gateway pinging it 4 times a second (the tiny model, 2 threads, on the 2-core VM); a
# starved worker's 2 threads, at a load of 40 on 2 cores, still get about 10 %. Many gateways
# pinging often could lift a stuck worker's own use above it: the hard limit ends that.
MIN_CPU_SHARE = 0.02


class Ticking(Protocol):
    """What the watchdog reads of the tick loop: when its current tick began, None between
    ticks and while it waits for work."""

    busy_since: float | None


@dataclass(slots=True)
class TickProgress:
    """Whether the current tick is stuck, from what the watchdog samples at each check: the
    time and the CPU-seconds the process has used. No clock or thread of its own, so a test
    gives it the times and CPU it wants."""

    limit: float  # seconds without CPU after which a tick is stuck
    hard_limit: float  # seconds after which a tick is stuck, CPU or not
    min_share: float = MIN_CPU_SHARE
    _tick: float | None = None  # the busy_since of the tick being watched
    # (time, CPU-seconds) of this tick, the oldest the latest at least a limit old
    _samples: deque[tuple[float, float]] = field(default_factory=deque)

    def check(self, busy_since: float | None, now: float, cpu: float) -> str | None:
        """Why the tick that began at `busy_since` (None: no tick) is stuck at `now`, having
        used `cpu` CPU-seconds in all; None while it is not."""
        if busy_since != self._tick:  # a new tick, or none
            self._tick = busy_since
            self._samples.clear()
        if busy_since is None:
            return None
        samples = self._samples
        samples.append((now, cpu))
        while len(samples) > 1 and now - samples[1][0] >= self.limit:
            samples.popleft()
        age = now - busy_since
        if age > self.hard_limit:
            return f"a tick has run for {age:.1f} s (hard limit {self.hard_limit:g} s)"
        since, cpu_then = samples[0]
        window = now - since
        if window >= self.limit and cpu - cpu_then < self.min_share * window:
            return (
                f"a tick has run for {age:.1f} s, the last {window:.1f} s without using CPU "
                f"({cpu - cpu_then:.3f} CPU-s; limit {self.limit:g} s)"
            )
        return None


class Watchdog:
    """A daemon thread that calls `on_stuck(why)` once, for a tick that has used no CPU for
    `limit` seconds, one older than `hard_limit` (default HARD_LIMIT_FACTOR limits), or one
    that outlives a stop signal by `stop_grace`; on_stuck is expected to end the process.
    `cpu_seconds` and `clock` are the process's CPU time and the loop's clock (busy_since)."""

    def __init__(
        self,
        loop: Ticking,
        limit: float,
        stop_grace: float,
        on_stuck: Callable[[str], None],
        hard_limit: float | None = None,
        cpu_seconds: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loop = loop
        self.limit = limit
        self.stop_grace = stop_grace
        self.on_stuck = on_stuck
        self.hard_limit = hard_limit if hard_limit is not None else HARD_LIMIT_FACTOR * limit
        self.progress = TickProgress(limit, self.hard_limit)
        self._cpu_seconds = cpu_seconds
        self._clock = clock
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
            now = self._clock()
            if readable and self._signalled() and signalled_at is None:
                signalled_at = now
            # A stop signal ends the loop within the shutdown timeout (it cuts what is left
            # then). Still running long after, it is stuck, in a tick or between ticks: a
            # deadlock there once left a scaled-in worker up for good (channels.Inbox).
            if signalled_at is not None and now - signalled_at > 2 * self.stop_grace + STOP_SLACK:
                self._fire(f"asked to stop {now - signalled_at:.1f} s ago, and still running")
                return
            started = self.loop.busy_since
            stuck = self.progress.check(started, now, self._cpu_seconds())
            if stuck is not None:
                self._fire(stuck)
                return
            if started is None:
                continue
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
