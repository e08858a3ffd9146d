"""The tick watchdog tells stuck from slow (tick/watchdog.py): a tick that keeps using CPU is
slow and may run up to the hard limit; one that used no CPU for its limit is stuck.

TickProgress is driven with made-up times and CPU-seconds (no clock, no thread); then the
real engine, on the tiny model, with a tick slowed by work that uses CPU (not declared dead)
and a tick that blocks without CPU inside it (declared dead), through the loop's on_tick hook,
which runs inside the tick."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.tick.loop import TickLoop
from loomserve.worker.tick.watchdog import MIN_CPU_SHARE, TickProgress, Watchdog
from tests.worker.engine.test_engine import GW, Collector, drain, greedy

LIMIT, HARD = 30.0, 300.0


def run_tick(progress: TickProgress, cpu_per_second: float, seconds: int, start: float = 0.0,
             cpu: float = 0.0) -> tuple[float | None, str | None, float]:  # fmt: skip
    """Checks once a second of a tick that began at `start`, using `cpu_per_second`: when it
    was found stuck (None: never), why, and the CPU-seconds used by the end."""
    for second in range(seconds + 1):
        now = start + second
        why = progress.check(start, now, cpu)
        if why is not None:
            return now, why, cpu
        cpu += cpu_per_second
    return None, None, cpu


def test_a_tick_that_keeps_using_cpu_is_slow_until_the_hard_limit() -> None:
    # A pass on a starved host: 10 % of a core for five minutes.
    stuck_at, why, _ = run_tick(TickProgress(LIMIT, HARD), 0.1, seconds=int(HARD))
    assert stuck_at is None, why
    stuck_at, why, _ = run_tick(TickProgress(LIMIT, HARD), 0.1, seconds=int(HARD) + 5)
    assert stuck_at == HARD + 1 and why is not None and "hard limit 300 s" in why


def test_a_tick_that_uses_no_cpu_for_its_limit_is_stuck() -> None:
    stuck_at, why, _ = run_tick(TickProgress(LIMIT, HARD), 0.0, seconds=100)
    assert stuck_at == LIMIT
    assert why is not None and "a tick has run for 30.0 s" in why and "without using CPU" in why
    # Heartbeats and the IO thread use a little CPU: still stuck.
    stuck_at, _, _ = run_tick(TickProgress(LIMIT, HARD), MIN_CPU_SHARE / 4, seconds=100)
    assert stuck_at == LIMIT


def test_a_slow_tick_that_stops_using_cpu_is_stuck_a_limit_later() -> None:
    progress = TickProgress(LIMIT, HARD)
    assert run_tick(progress, 0.5, seconds=100)[0] is None
    # The same tick (same start) goes on from 101 s, frozen now.
    cpu = 50.5
    for second in range(101, 200):
        why = progress.check(0.0, float(second), cpu)
        if why is not None:
            assert second == 100 + LIMIT  # the last sample with CPU used was at 100 s
            assert "a tick has run for 130.0 s, the last 30.0 s without using CPU" in why
            return
    raise AssertionError("a frozen tick was never found stuck")


def test_each_tick_and_waiting_for_work_start_afresh() -> None:
    progress = TickProgress(LIMIT, HARD)
    # Ticks of 20 s without CPU one after another: none alone is a limit old.
    for tick in range(10):
        start = tick * 20.0
        assert run_tick(progress, 0.0, seconds=19, start=start)[0] is None
    # Waiting for work (no tick) never is, however long.
    for second in range(1000):
        assert progress.check(None, 200.0 + second, 0.0) is None


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Iterator[tuple[Engine, WorkerConfig]]:
    config = WorkerConfig(model_path=tiny_model_path, slots=2, ctx_size=128, threads=1)
    engine = Engine(config)
    try:
        yield engine, config
    finally:
        engine.close()


def watched_run(
    engine: tuple[Engine, WorkerConfig],
    in_tick: Callable[[threading.Event], None],
    limit: float,
) -> tuple[list[str], Collector]:
    """A request of 6 tokens on the real engine, `in_tick` run inside its third tick, under
    a watchdog of `limit` seconds (the real process CPU time and clock); what the watchdog
    said, and what the request got. The watchdog's on_stuck, which would end the process,
    records why and sets the event `in_tick` is given, so the tick can go on."""
    engine_, config = engine
    fired: list[str] = []
    gave_up = threading.Event()
    ticks = 0

    def on_tick(_record: object) -> None:
        nonlocal ticks
        ticks += 1
        if ticks == 3:
            in_tick(gave_up)

    def on_stuck(why: str) -> None:
        fired.append(why)
        gave_up.set()

    loop = TickLoop(engine_, config, collector := Collector(), on_tick=on_tick)
    watchdog = Watchdog(loop, limit=limit, stop_grace=60.0, on_stuck=on_stuck, hard_limit=120.0)
    watchdog.start()
    try:
        loop.inbox.submit(GW, greedy("r", [1, 40, 41], max_tokens=6, ignore_eos=True))
        drain(loop)
    finally:
        watchdog.stop()
    assert collector.finishes()["r"].reason == "length" and len(collector.tokens()["r"]) == 6
    return fired, collector


def test_a_real_tick_slowed_by_work_that_uses_cpu_is_not_declared_dead(engine) -> None:
    limit = 0.3

    def slow(_gave_up: threading.Event) -> None:  # eight limits of CPU time, inside the tick
        spent = time.thread_time()
        while time.thread_time() - spent < 8 * limit:
            sum(range(1000))

    started = time.monotonic()
    fired, _ = watched_run(engine, slow, limit)
    assert time.monotonic() - started > 8 * limit  # the tick did outlast its limit, eightfold
    assert fired == []


def test_a_real_tick_starved_by_busy_processes_is_not_declared_dead(engine) -> None:
    """Three processes busy-looping on the tick thread's core: the tick gets a share of it,
    runs for several limits, and is slow, not dead."""
    limit = 0.3
    core = min(os.sched_getaffinity(0))
    busy = (
        f"import os, time\nos.sched_setaffinity(0, {{{core}}})\n"
        "end = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    )
    loops = [subprocess.Popen([sys.executable, "-c", busy]) for _ in range(3)]

    def starved(_gave_up: threading.Event) -> None:  # two limits of CPU time, on that core
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {core})
        try:
            spent = time.thread_time()
            while time.thread_time() - spent < 2 * limit:
                sum(range(1000))
        finally:
            os.sched_setaffinity(0, before)

    try:
        started = time.monotonic()
        fired, _ = watched_run(engine, starved, limit)
        took = time.monotonic() - started
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert took > 4 * limit  # a quarter of a core or so: starved well past its limit
    assert fired == []


def test_a_real_tick_that_blocks_without_cpu_is_declared_dead(engine) -> None:
    def block(gave_up: threading.Event) -> None:  # waits, using no CPU, for the watchdog
        gave_up.wait(timeout=60)

    fired, _ = watched_run(engine, block, limit=0.5)
    assert len(fired) == 1 and "without using CPU" in fired[0], fired
