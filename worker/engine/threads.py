"""How many threads the worker's forward passes use: fewer while other processes take its CPUs.

llama.cpp's CPU passes run on OpenMP threads that meet at hundreds of barriers a pass, and a
thread that reaches one spins while it waits (worker/openmp.py). When other processes keep
the worker's cores busy (a laptop's browser, a CI runner's other jobs), a thread that spins
at a barrier while its partner has lost its core holds its own core for the whole spin, at
every barrier: measured on this project's 2-core VM with 2 busy-looping processes beside it,
a single stream of Gemma 3 270M fell from 45 to 6 tok/s (0.13x; llama-server to 7). One
thread has no barriers to wait at, and gets its fair share of a core.

So four times a second a thread of the governor's reads how busy the worker's CPUs (its affinity
mask) were (/proc/stat) and how much of that was the worker itself (/proc/self/stat): what is
left is the other processes' use, and the CPUs they leave free are the threads worth running,
at least one and at most --threads. Fewer threads need two windows in a row that agree, so a
burst does not take one away; more come after one window, and an idle worker (no pass ran in
the window, none is running) starts its next passes on all of them. Idle is read from the
passes, not from the worker's own CPU time: a worker starved by its neighbours uses little CPU
too, and taking that for idle gave it back every thread in the middle of a run, each spinning
at the barriers for a partner without a core, until two windows took them away again. It
reads while the worker idles too, and never waits for a pass (a collapsed one may take
seconds). `llama_set_n_threads`
applies a change from the next pass. Alone on its CPUs the
worker keeps all its threads, and its passes run as before: the count of threads does not
change a row's arithmetic (each row is one thread's work), so outputs are the same.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

WINDOW_SECONDS = 0.25  # how often the CPUs' use is read (/proc counts in 10 ms ticks)
AGREEING_WINDOWS = 2  # windows in a row that must ask for fewer threads
PROC_STAT = Path("/proc/stat")
PROC_SELF_STAT = Path("/proc/self/stat")


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Cumulative CPU time, in clock ticks: the worker's CPUs busy, and the worker itself."""

    busy: int  # user, nice, system, irq, softirq and steal on the worker's CPUs
    own: int  # this process's user and system time, every thread


def read_cpu_times(
    cpus: frozenset[int], proc_stat: Path = PROC_STAT, proc_self_stat: Path = PROC_SELF_STAT
) -> CpuTimes:
    """The CPU times now (files are parameters for tests)."""
    busy = 0
    for line in proc_stat.read_text().splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        counts = [int(value) for value in rest.split()]
        user, nice, system, _idle, _iowait, irq, softirq = counts[:7]
        steal = counts[7] if len(counts) > 7 else 0
        busy += user + nice + system + irq + softirq + steal
    # The command may hold spaces and parentheses: the fields start after the last ')'.
    stat = proc_self_stat.read_text().rpartition(")")[2].split()
    own = int(stat[11]) + int(stat[12])  # utime, stime (the 14th and 15th fields)
    return CpuTimes(busy, own)


class ThreadGovernor:
    """The threads the next pass should use, from the CPUs other processes leave free: read
    by a thread of its own once a window (a pass that collapsed may take seconds: the reading
    must not wait for it), while the worker decodes or idles."""

    def __init__(
        self,
        most: int,
        cpus: frozenset[int],
        read: Callable[[], CpuTimes],
        ticks_per_second: float,
        clock: Callable[[], float],
    ) -> None:
        self.most = most
        self.threads = most  # what the next pass uses (an int: read without a lock)
        self._cpus = len(cpus)
        self._read = read
        self._ticks_per_second = ticks_per_second
        self._clock = clock
        self._last_at = clock()
        self._last = read()
        self._wanted: int | None = None  # a change asked for by the windows so far
        self._agreeing = 0
        # The passes, counted as each starts and ends (pass_started, pass_ended), and whether
        # one runs now: a window in which none ran is idle. Written by the tick's thread,
        # read by the governor's (ints and a bool: no lock).
        self._pass_events = 0
        self._in_pass = False
        self._last_pass_events = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_this_process(cls, most: int) -> ThreadGovernor | None:
        """A governor over this process's CPUs, reading them from now on, or None where it
        cannot read them (not Linux) or has nothing to govern (one thread)."""
        if most < 2 or not PROC_STAT.exists() or not PROC_SELF_STAT.exists():
            return None
        try:
            cpus = frozenset(os.sched_getaffinity(0))
        except AttributeError:
            return None
        governor = cls(
            most,
            cpus,
            lambda: read_cpu_times(cpus),
            float(os.sysconf("SC_CLK_TCK")),
            time.monotonic,
        )
        governor._thread = threading.Thread(
            target=governor._run, name="thread-governor", daemon=True
        )
        governor._thread.start()
        return governor

    def _run(self) -> None:
        while not self._stop.wait(WINDOW_SECONDS):
            try:
                self.observe()
            except (OSError, ValueError, IndexError):  # /proc unreadable: keep what is set
                continue

    def update(self) -> int:
        """The threads the next pass should use."""
        return self.threads

    def pass_started(self) -> None:
        """A pass begins (the engine's decode)."""
        self._in_pass = True
        self._pass_events += 1

    def pass_ended(self) -> None:
        """The pass is over."""
        self._in_pass = False
        self._pass_events += 1

    def observe(self) -> int:
        """Read one window: the CPUs other processes used since the last reading, and the
        threads they leave room for. Fewer threads after AGREEING_WINDOWS windows in a row
        ask for them (a burst must not take a thread away); more at once (were the neighbours
        still there, the next windows would say so)."""
        now = self._clock()
        elapsed = now - self._last_at
        times = self._read()
        if elapsed <= 0:
            return self.threads
        others = (times.busy - self._last.busy) - (times.own - self._last.own)
        self._last, self._last_at = times, now
        others_cpus = max(0.0, others / self._ticks_per_second / elapsed)
        events = self._pass_events
        idle = events == self._last_pass_events and not self._in_pass
        self._last_pass_events = events
        # Idle, what the others do says nothing of how the next passes will fare (another
        # server's run on the same CPUs ends when this one's begins): all threads.
        free = self._cpus - others_cpus
        wanted = self.most if idle else max(1, min(self.most, int(free + 0.5)))
        if wanted == self.threads:
            self._wanted, self._agreeing = None, 0
            return self.threads
        self._agreeing = self._agreeing + 1 if wanted == self._wanted else 1
        self._wanted = wanted
        if wanted > self.threads or self._agreeing >= AGREEING_WINDOWS:
            log.info(
                "passes' threads changed: other processes use the worker's CPUs"
                if wanted < self.threads
                else "passes' threads changed: the worker's CPUs are free again",
                threads=wanted,
                before=self.threads,
                others_cpus=round(others_cpus, 2),
                cpus=self._cpus,
            )
            self.threads, self._wanted, self._agreeing = wanted, None, 0
        return self.threads

    def close(self) -> None:
        """Stop reading."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
