"""Process supervision for `loomserve serve`: start the children, restart the ones that crash,
stop them all on Ctrl-C or SIGTERM.

A child that crashes is restarted after a delay that doubles with each quick death, up to a
cap, for as long as it takes: one child's crash loop must not stop the others serving. Two
kinds of child make the supervisor give up, so start-up fails fast: one that exits with
EXIT_CONFIG (it found its settings or its model unusable, and says why in its log), and one
that has never come up (it died within seconds of every start before serve was ever ready).

Children started on demand (a model's workers, started and stopped by cli/models.py) are not
started with the rest; stopping one on purpose is not a crash, and one that fails on its
configuration fails its model only, not the whole of serve.

Each child runs in its own session, so a Ctrl-C at the terminal reaches the supervisor only and
the shutdown happens in stages: the gateways first, together, then the worker (so in-flight
requests can finish), each stage with SIGTERM and a grace period before SIGKILL.
On Linux each child also dies with the supervisor, even when the supervisor is SIGKILLed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger(__name__)

QUICK_EXIT_SECONDS = 10.0  # a child that dies sooner than this after starting is crash-looping
MAX_QUICK_EXITS = 5  # consecutive quick deaths of a never-up child before giving up
MAX_RESTART_DELAY = 30.0
# The status of a child that failed on its configuration (sysexits' EX_CONFIG, as the worker
# and the gateway exit): a restart would fail the same way, so it is never restarted.
EXIT_CONFIG = os.EX_CONFIG
POLL_SECONDS = 0.1
READY_PROBE_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How to start one child process."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    stop_stage: int = 0  # higher stages stop first; children in one stage stop together
    on_demand: bool = False  # started by start_child() only, not with the rest


@dataclass(slots=True)
class Child:
    """One supervised child and its restart bookkeeping."""

    spec: ChildSpec
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    quick_exits: int = 0  # consecutive deaths within QUICK_EXIT_SECONDS of starting
    restart_at: float | None = None  # when a crashed child is due to start again
    restarts: int = 0
    # Ran QUICK_EXIT_SECONDS, or was running when serve was ready: it can start, so a crash
    # later is retried for ever rather than taken for bad configuration.
    ever_up: bool = False
    # Whether it should be running: False for an on-demand child not started yet, and for
    # one being stopped on purpose (its exit is then no crash and it is not restarted).
    wanted: bool = True
    failed: str | None = None  # why an on-demand child was given up on (its configuration)
    stop_deadline: float = 0.0  # when a child stopped on purpose gets SIGKILL

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None


@dataclass(slots=True)
class _Signals:
    """What the signal handlers saw; the supervision loop reads it."""

    stop: bool = False
    force: bool = False  # a second signal: kill everything now
    received: list[int] = field(default_factory=list)


class Supervisor:
    """Keeps a fixed set of children running until asked to stop."""

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        *,
        stop_timeout: float = 15.0,
        restart_delay: float = 0.5,
        max_restart_delay: float = MAX_RESTART_DELAY,
        ready_probe: Callable[[], bool] | None = None,
        on_ready: Callable[[], None] | None = None,
        on_exit: Callable[[Child, int], None] | None = None,
        on_poll: Callable[[float], None] | None = None,
    ) -> None:
        self.children = [Child(spec, wanted=not spec.on_demand) for spec in specs]
        self.stop_timeout = stop_timeout
        self.restart_delay = restart_delay  # doubles with each quick death
        self.max_restart_delay = max_restart_delay
        self.ready_probe = ready_probe
        self.on_ready = on_ready
        self.on_exit = on_exit
        self.on_poll = on_poll  # called every loop round with time.monotonic()
        self._signals = _Signals()
        self._ready = False
        self._next_probe = 0.0

    def run(self) -> int:
        """Start every child and supervise until SIGINT/SIGTERM; the exit status to use."""
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            for child in self.children:
                if child.wanted and child.process is None:  # (start_child may have run)
                    self._start(child)
            status = self._supervise()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return status

    def _supervise(self) -> int:
        while not self._signals.stop:
            now = time.monotonic()
            for child in self.children:
                if child.process is None:
                    if child.restart_at is not None and now >= child.restart_at:
                        child.restarts += 1
                        self._start(child)
                    continue
                returncode = child.process.poll()
                if returncode is None:
                    if now - child.started_at >= QUICK_EXIT_SECONDS:
                        child.ever_up = True
                    if not child.wanted and now >= child.stop_deadline:
                        log.warning("killing", child=child.spec.name, pid=child.process.pid)
                        _signal_group(child.process, signal.SIGKILL)
                        child.stop_deadline = float("inf")
                elif not child.wanted:
                    self._stopped(child, returncode)
                elif (status := self._handle_exit(child, returncode, now)) is not None:
                    return status
            self._probe_readiness(now)
            if self.on_poll is not None:
                self.on_poll(now)
            time.sleep(POLL_SECONDS)
        log.info("stopping", signal=signal.Signals(self._signals.received[0]).name)
        return 0

    def start_child(self, child: Child) -> None:
        """Start an on-demand child (or keep it running, if it is being stopped)."""
        child.wanted, child.failed = True, None
        child.quick_exits, child.ever_up = 0, False
        if child.process is None:
            self._start(child)

    def stop_child(self, child: Child) -> None:
        """Ask a child to stop (SIGTERM: it drains); it is not restarted. stopping(child)
        is False once it has exited; SIGKILL after stop_timeout."""
        child.wanted = False
        child.restart_at = None
        if child.process is not None:
            _signal_group(child.process, signal.SIGTERM)
            child.stop_deadline = time.monotonic() + self.stop_timeout

    def _start(self, child: Child) -> None:
        child.process = subprocess.Popen(
            _dying_with_parent(child.spec.argv),
            env=dict(child.spec.env),
            start_new_session=True,  # Ctrl-C at the terminal goes to the supervisor only
        )
        child.started_at = time.monotonic()
        child.restart_at = None
        log.info("started", child=child.spec.name, pid=child.process.pid)

    def _stopped(self, child: Child, returncode: int) -> None:
        """A child stopped on purpose has exited."""
        pid = child.process.pid if child.process else None
        child.process = None
        log.info("stopped", child=child.spec.name, pid=pid, status=describe_returncode(returncode))
        if self.on_exit and pid is not None:
            self.on_exit(child, pid)

    def _handle_exit(self, child: Child, returncode: int, now: float) -> int | None:
        """Report a child's death and schedule its restart; or the status to give up with,
        when it failed on its configuration or never came up."""
        pid = child.process.pid if child.process else None
        child.process = None
        uptime = now - child.started_at
        child.quick_exits = child.quick_exits + 1 if uptime < QUICK_EXIT_SECONDS else 0
        log.error(
            "child exited",
            child=child.spec.name,
            pid=pid,
            status=describe_returncode(returncode),
            uptime_s=round(uptime, 1),
        )
        if self.on_exit and pid is not None:
            self.on_exit(child, pid)
        if returncode == EXIT_CONFIG and child.spec.on_demand:
            # One model's worker: its model is unusable, the others serve on.
            log.error("child failed on its configuration; not restarted", child=child.spec.name)
            child.wanted, child.failed = False, "its worker failed on its configuration"
            return None
        if returncode == EXIT_CONFIG:
            log.error("giving up: child failed on its configuration", child=child.spec.name)
            return EXIT_CONFIG
        if self._ready:
            log.warning("not ready: a child is down", child=child.spec.name)
        self._ready = False
        if child.quick_exits >= MAX_QUICK_EXITS and not child.ever_up and child.spec.on_demand:
            log.error("child never came up; not restarted", child=child.spec.name)
            child.wanted, child.failed = False, f"its worker crashed {MAX_QUICK_EXITS} times"
            return None
        if child.quick_exits >= MAX_QUICK_EXITS and not child.ever_up:
            log.error(
                "giving up: child never came up", child=child.spec.name, crashes=MAX_QUICK_EXITS
            )
            return 1
        delay = min(self.max_restart_delay, self.restart_delay * 2**child.quick_exits)
        child.restart_at = now + delay
        log.warning(
            "restarting",
            child=child.spec.name,
            in_s=round(delay, 3),
            quick_exits=child.quick_exits,
            restarts=child.restarts,
        )
        return None

    def _probe_readiness(self, now: float) -> None:
        if self._ready or self.ready_probe is None or now < self._next_probe:
            return
        self._next_probe = now + READY_PROBE_SECONDS
        running = all(child.process is not None for child in self.children if child.wanted)
        if running and self.ready_probe():
            self._ready = True
            for child in self.children:
                child.ever_up = child.ever_up or child.process is not None
            if self.on_ready:
                self.on_ready()

    def _stop_all(self) -> None:
        """Stop the children stage by stage, highest first: SIGTERM to the whole stage at
        once, then SIGKILL to those still running after stop_timeout."""
        for stage in sorted({child.spec.stop_stage for child in self.children}, reverse=True):
            running = [
                (child, child.process)
                for child in self.children
                if child.spec.stop_stage == stage and child.process is not None
            ]
            for _, process in running:
                _signal_group(process, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout
            while any(process.poll() is None for _, process in running):
                if self._signals.force or time.monotonic() >= deadline:
                    break
                time.sleep(POLL_SECONDS / 2)
            for child, _ in running:
                self._reap(child)

    def _reap(self, child: Child) -> None:
        process = child.process
        assert process is not None
        if process.poll() is None:
            log.warning("killing", child=child.spec.name, pid=process.pid)
            _signal_group(process, signal.SIGKILL)
            process.wait()
        log.info(
            "stopped",
            child=child.spec.name,
            pid=process.pid,
            status=describe_returncode(process.returncode),
        )
        child.process = None

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.received.append(signum)
        if self._signals.stop:
            self._signals.force = True
        self._signals.stop = True


def describe_returncode(returncode: int) -> str:
    """'exit 3' or 'killed by SIGKILL', from a Popen returncode."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _dying_with_parent(argv: Sequence[str]) -> list[str]:
    """argv behind a small Python prelude that asks Linux to SIGTERM the child when the
    supervisor dies, then execs it (same pid). A prelude, not preexec_fn: running Python
    between fork and exec is unsafe in a process with threads."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _PDEATHSIG_PRELUDE, str(os.getpid()), *argv]


_PDEATHSIG_PRELUDE = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # the supervisor died before prctl took effect
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT: processes holding one share the port, and the
    kernel spreads new connections across them."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def check_port_free(host: str, port: int) -> None:
    """Raise OSError when anything listens on host:port.

    The probe binds without SO_REUSEPORT, so it also fails on a port another loomserve holds:
    joining that server's reuse-port group would silently split traffic between the two.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(address)
