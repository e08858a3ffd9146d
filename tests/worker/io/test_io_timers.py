"""The IO thread's own timers (heartbeats, the silence check) wake it once each: it waits in
whole milliseconds, rounded up, so no poll comes back just before a deadline and leaves the
thread turning on zero-timeout polls until it passes. In process, no gateway."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq

from loomserve.protocol import PROTOCOL_VERSION, ModelInfo
from loomserve.worker.config import WorkerConfig
from loomserve.worker.io.channels import Inbox, StatsBoard
from loomserve.worker.io.sockets import WorkerIO

SLOTS = 2
INFO = ModelInfo(PROTOCOL_VERSION, "tiny", 256, 512, 512, SLOTS, "fingerprint", True)
INTERVAL = 0.05  # heartbeats and silence checks both: a deadline every 50 ms
WATCH_SECONDS = 1.0


class CountingPoller(zmq.Poller):
    polls = 0

    def poll(self, timeout: int | None = None) -> list[tuple[object, int]]:
        CountingPoller.polls += 1
        return super().poll(timeout)


def test_each_timer_deadline_wakes_the_io_thread_about_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(zmq, "Poller", CountingPoller)
    config = WorkerConfig(
        model_path=tmp_path / "model.gguf",
        slots=SLOTS,
        bind=f"ipc://{tmp_path}/worker.ipc",
        heartbeat_interval=INTERVAL,
        gateway_timeout=INTERVAL * 10,  # its check every tenth: the same 50 ms
    )
    io = WorkerIO(config, INFO, Inbox(), StatsBoard(SLOTS))
    io.start()
    try:
        time.sleep(0.2)  # past the first turns
        before = CountingPoller.polls
        time.sleep(WATCH_SECONDS)
        turns = CountingPoller.polls - before
    finally:
        io.close()
    deadlines = WATCH_SECONDS / INTERVAL  # 20
    # Woken once a deadline (a late wake-up may find the next one close: a few more).
    assert turns <= 2 * deadlines, f"{turns} turns for {deadlines:.0f} deadlines"
