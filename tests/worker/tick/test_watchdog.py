"""The tick watchdog (tick/watchdog.py) on a stop signal: a loop that is not in a tick but
has still not ended long after the shutdown timeout is stuck too. No model: a stand-in loop
that never ticks, and a real SIGTERM to this process (caught by a no-op handler here, seen
by the watchdog through signal.set_wakeup_fd)."""

from __future__ import annotations

import os
import signal
import threading
import time

from loomserve.worker.tick import watchdog as watchdog_module
from loomserve.worker.tick.watchdog import Watchdog


class NeverTicking:
    busy_since: float | None = None  # waiting for work, as the loop does between ticks


def test_a_loop_stuck_between_ticks_after_a_stop_signal_is_given_up(monkeypatch) -> None:
    monkeypatch.setattr(watchdog_module, "STOP_SLACK", 0.2)
    fired: list[str] = []
    done = threading.Event()

    def on_stuck(why: str) -> None:
        fired.append(why)
        done.set()

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    watchdog = Watchdog(NeverTicking(), limit=1.0, stop_grace=0.3, on_stuck=on_stuck)
    watchdog.start()
    try:
        time.sleep(0.3)
        assert not fired  # waiting for work is not being stuck
        signalled = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        assert done.wait(10), "the watchdog never gave up on the stopping loop"
        waited = time.monotonic() - signalled
    finally:
        watchdog.stop()
        signal.signal(signal.SIGTERM, previous)
    assert waited >= 2 * 0.3 + 0.2  # the whole drain's time first
    assert fired and "asked to stop" in fired[0] and "still running" in fired[0]


def test_without_a_stop_signal_waiting_for_work_is_never_stuck() -> None:
    fired: list[str] = []
    watchdog = Watchdog(NeverTicking(), limit=0.2, stop_grace=0.1, on_stuck=fired.append)
    watchdog.start()
    time.sleep(1.0)
    watchdog.stop()
    assert not fired
