"""The passes' threads follow the CPUs other processes leave free (worker/engine/threads.py):
the readings of /proc, the governor's decisions on a fake clock, and the real engine giving
the same tokens whatever its passes' threads."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest

from loomserve.protocol import Generate, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.engine.media import MediaEncoder
from loomserve.worker.engine.threads import (
    AGREEING_WINDOWS,
    WINDOW_SECONDS,
    CpuTimes,
    ThreadGovernor,
    read_cpu_times,
)
from tests.tiny_vision_model import png_bytes
from tests.worker.engine.test_engine import GW, drain, new_loop

PROC_STAT = """cpu  900 0 300 5000 10 0 5 0 0 0
cpu0 100 0 50 2000 5 0 1 0 0 0
cpu1 200 0 60 1500 5 0 2 7 0 0
cpu2 600 0 190 1500 0 0 2 0 0 0
intr 12345
"""
# pid (comm with a space and a paren)) state ppid ... utime=41 stime=9 (fields 14 and 15)
PROC_SELF_STAT = "4242 (python (x) y) S 1 2 3 4 5 6 7 8 9 10 41 9 0 0 20 0 3 0 100 1000 50\n"


def test_cpu_times_are_read_for_the_workers_cpus_only(tmp_path: Path) -> None:
    stat, own = tmp_path / "stat", tmp_path / "self_stat"
    stat.write_text(PROC_STAT)
    own.write_text(PROC_SELF_STAT)
    times = read_cpu_times(frozenset({0, 1}), stat, own)
    # cpu0: 100 + 50 + 1; cpu1: 200 + 60 + 2 + 7 (steal); cpu2 is not the worker's.
    assert times == CpuTimes(busy=151 + 269, own=50)


class FakeCpus:
    """A clock and CPU counters that the test moves: others' and the worker's CPUs in use."""

    TICKS = 100.0

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0
        self.own = 0

    def run(self, seconds: float, others: float, own: float) -> None:
        self.now += seconds
        self.own += round(own * seconds * self.TICKS)
        self.busy += round((others + own) * seconds * self.TICKS)

    def times(self) -> CpuTimes:
        return CpuTimes(self.busy, self.own)


def governor(cpus: FakeCpus, most: int = 2) -> ThreadGovernor:
    return ThreadGovernor(most, frozenset(range(2)), cpus.times, cpus.TICKS, lambda: cpus.now)


def window(threads: ThreadGovernor, cpus: FakeCpus, others: float, own: float) -> int:
    """One window in which the worker runs passes (own CPUs > 0) or idles; its reading."""
    cpus.run(WINDOW_SECONDS, others=others, own=own)
    if own > 0:
        threads.pass_started()
        threads.pass_ended()
    return threads.observe()


def test_alone_the_worker_keeps_all_its_threads() -> None:
    cpus = FakeCpus()
    threads = governor(cpus)
    for _ in range(10):
        assert window(threads, cpus, others=0.2, own=1.8) == 2  # a gateway's bit beside it


def test_busy_neighbours_take_threads_away_and_give_them_back() -> None:
    cpus = FakeCpus()
    threads = governor(cpus)
    # two busy loops share the cores; one window is not enough: a burst must not flip it
    assert window(threads, cpus, others=1.0, own=1.0) == 2
    for _ in range(AGREEING_WINDOWS - 1):
        window(threads, cpus, others=1.0, own=1.0)
    assert threads.threads == 1
    assert window(threads, cpus, others=1.33, own=0.67) == 1  # one thread's fair share
    # the neighbours are gone: more threads at once
    assert window(threads, cpus, others=0.05, own=1.0) == 2


def test_an_idle_worker_starts_its_next_passes_on_all_its_threads() -> None:
    """Idle (no pass in the window), the worker reads nothing of how its passes fare
    (another server's run on the same CPUs ends when its own begins): all its threads, at
    once."""
    cpus = FakeCpus()
    threads = governor(cpus)
    for _ in range(AGREEING_WINDOWS):
        window(threads, cpus, others=1.2, own=0.8)
    assert threads.threads == 1
    assert window(threads, cpus, others=2.0, own=0.0) == 2  # idle, the CPUs full of others'


def test_a_starved_worker_is_not_taken_for_idle() -> None:
    """Starved by its neighbours, the worker uses little CPU, as an idle one does; but its
    passes go on (or one runs the whole window), so it keeps its one thread. Taken for idle,
    it got both back in the middle of a run, each spinning for a partner without a core."""
    cpus = FakeCpus()
    threads = governor(cpus)
    for _ in range(AGREEING_WINDOWS):
        window(threads, cpus, others=1.6, own=0.4)
    assert threads.threads == 1
    assert window(threads, cpus, others=1.98, own=0.02) == 1  # passes, barely any CPU
    threads.pass_started()  # a pass that lasts the next windows
    for _ in range(3):
        cpus.run(WINDOW_SECONDS, others=2.0, own=0.0)
        assert threads.observe() == 1
    cpus.run(WINDOW_SECONDS, others=2.0, own=0.0)
    threads.pass_ended()
    assert threads.observe() == 1  # it ended in this window: not idle yet
    cpus.run(WINDOW_SECONDS, others=2.0, own=0.0)
    assert threads.observe() == 2  # no pass in the window: idle


def test_a_window_that_disagrees_starts_the_count_again() -> None:
    cpus = FakeCpus()
    threads = governor(cpus)
    for others in (1.2, 0.0, 1.2, 0.0):
        assert window(threads, cpus, others=others, own=0.8) == 2


def test_a_worker_of_one_thread_has_nothing_to_govern() -> None:
    assert ThreadGovernor.for_this_process(1) is None


def test_this_process_is_read_on_a_thread_until_closed() -> None:
    governor = ThreadGovernor.for_this_process(2)
    assert governor is not None  # Linux: /proc is there
    assert governor.update() in (1, 2)
    assert 1 <= governor.observe() <= 2  # the real /proc reads
    governor.close()
    assert governor._thread is not None and not governor._thread.is_alive()


class FixedCount:
    """A stand-in for the governor that decides without reading the passes."""

    def pass_started(self) -> None:
        """Not read."""

    def pass_ended(self) -> None:
        """Not read."""


class Alternating(FixedCount):
    """A governor that changes the passes' threads at every pass: 1, 2, 1, 2, ..."""

    def __init__(self) -> None:
        self.threads = 2
        self.changes = 0

    def update(self) -> int:
        self.threads = 3 - self.threads
        self.changes += 1
        return self.threads

    def close(self) -> None:
        """Nothing to stop."""


@pytest.fixture(scope="module")
def config(tiny_model_path: Path) -> WorkerConfig:
    return WorkerConfig(model_path=tiny_model_path, slots=4, ctx_size=256, threads=2)


def greedy_tokens(config: WorkerConfig, alternate: bool) -> dict[str, list[int]]:
    engine = Engine(replace(config, adaptive_threads=False))
    try:
        if alternate:
            engine.threads = Alternating()  # type: ignore[assignment]
        loop, collector = new_loop(engine, config)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(([1, 40, 41, 42], [1, 50, 51], [1, 60, 61, 62, 63])):
            loop.inbox.submit(GW, Generate(f"r{i}", prompt, params))
        drain(loop)
        if alternate:
            assert engine.threads.changes > 20  # type: ignore[union-attr]
        return collector.tokens()
    finally:
        engine.close()


def test_the_passes_threads_do_not_change_the_tokens(config: WorkerConfig) -> None:
    assert greedy_tokens(config, alternate=True) == greedy_tokens(config, alternate=False)


class SetElsewhere(FixedCount):
    """A governor whose count another thread sets, as the real one's reading thread does."""

    threads = 2

    def update(self) -> int:
        return self.threads

    def close(self) -> None:
        """Nothing to stop."""


def test_the_engine_applies_a_count_set_by_the_governors_thread(config: WorkerConfig) -> None:
    engine = Engine(replace(config, adaptive_threads=False))
    try:
        governor = engine.threads = SetElsewhere()  # type: ignore[assignment]
        loop, _ = new_loop(engine, config)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        loop.inbox.submit(GW, Generate("a", [1, 40, 41], params))
        drain(loop)
        assert engine._passes_threads == 2
        governor.threads = 1  # the reading thread's decision, between passes
        loop.inbox.submit(GW, Generate("b", [1, 40, 41], params))
        drain(loop)
        assert engine._passes_threads == 1
    finally:
        engine.close()


def test_threads_lent_to_the_image_encoder_leave_the_passes_the_rest(
    config: WorkerConfig,
) -> None:
    """While an image encodes on half the worker's threads, the passes run on the other half,
    and on all of them again once it is done."""
    engine = Engine(replace(config, adaptive_threads=False))
    try:
        loop, _ = new_loop(engine, config)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.lend_threads(1)
        loop.inbox.submit(GW, Generate("a", [1, 40, 41], params))
        drain(loop)
        assert engine._passes_threads == 1
        engine.lend_threads(0)
        loop.inbox.submit(GW, Generate("b", [1, 40, 41], params))
        drain(loop)
        assert engine._passes_threads == 2
        engine.lend_threads(8)  # more than it has: one thread is always left to the passes
        loop.inbox.submit(GW, Generate("c", [1, 40, 41], params))
        drain(loop)
        assert engine._passes_threads == 1
    finally:
        engine.close()


def test_the_image_encoder_borrows_its_threads_only_while_it_encodes(
    config: WorkerConfig, tiny_mmproj_path: Path
) -> None:
    engine = Engine(replace(config, adaptive_threads=False, mmproj=tiny_mmproj_path))
    lent: list[int] = []
    finished = threading.Event()
    encoder = MediaEncoder(
        tiny_mmproj_path,
        engine.model,
        2,
        False,
        lambda *_: finished.set(),
        lent.append,
    )
    try:
        assert encoder.threads == 1  # half of 2, on the CPU
        request = Generate("img", [1, 40, 41], SamplingParams(max_tokens=2))
        request.images, request.image_at = [png_bytes(32, 32)], [1]
        encoder.submit(GW, request)
        assert finished.wait(60)
        assert lent == [1, 0]
    finally:
        encoder.close()
        engine.close()
