"""The supervisor on plain Python children: restarts, crash loops, stop order, SIGKILL, orphans.

Most children are stand-ins on purpose: what is under test is process handling, not serving
(tests/cli/test_cli.py runs `serve` on the real worker and gateways). The last test kills the real
worker under `serve` again and again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from loomserve.cli.supervisor import (
    EXIT_CONFIG,
    MAX_QUICK_EXITS,
    ChildSpec,
    Supervisor,
    describe_returncode,
)
from tests.cli.test_cli import ROOT, Served, children_of, clean_env, role, wait_until
from tests.procs import free_port


def python_child(name: str, code: str, workdir: Path, stop_stage: int = 0) -> ChildSpec:
    """A child running `code`; note() appends '<event> <pid> <ns>' lines to <workdir>/<name>.log."""
    prelude = textwrap.dedent(
        f"""
        import os, signal, sys, time
        def note(event):
            with open({str(workdir / f"{name}.log")!r}, "a") as f:
                f.write(f"{{event}} {{os.getpid()}} {{time.time_ns()}}\\n")
        """
    )
    argv = [sys.executable, "-c", prelude + code]
    return ChildSpec(name=name, argv=argv, env=dict(os.environ), stop_stage=stop_stage)


def events(workdir: Path, name: str) -> list[tuple[str, int, int]]:
    """(event, pid, time in ns) for each note() of the child called `name`."""
    path = workdir / f"{name}.log"
    if not path.exists():
        return []
    lines = [line.split() for line in path.read_text().splitlines()]
    return [(event, int(pid), int(ns)) for event, pid, ns in lines]


def signal_self_when(condition: Callable[[], bool], timeout: float = 20.0) -> threading.Thread:
    """SIGTERM this process (the supervisor under test) once condition() holds, or at timeout."""

    def wait_then_signal() -> None:
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=wait_then_signal, daemon=True)
    thread.start()
    return thread


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


SLEEPER = "note('start')\nsignal.signal(signal.SIGTERM, lambda *_: (note('term'), sys.exit(0)))\n"
SLEEPER += "time.sleep(60)\n"


def test_crashed_child_is_restarted_and_higher_stages_stop_first(tmp_path: Path) -> None:
    marker = tmp_path / "crashed-once"
    crash_once = (
        f"if not os.path.exists({str(marker)!r}):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    note('crash')\n"
        "    sys.exit(3)\n" + SLEEPER
    )
    supervisor = Supervisor(
        [
            python_child("first", SLEEPER, tmp_path),
            python_child("second", crash_once, tmp_path, stop_stage=1),
        ],
        restart_delay=0.05,
    )
    signal_self_when(lambda: len(events(tmp_path, "second")) == 2 and events(tmp_path, "first"))
    assert supervisor.run() == 0

    first, second = events(tmp_path, "first"), events(tmp_path, "second")
    assert [event for event, _, _ in second] == ["crash", "start", "term"]
    assert second[0][1] != second[1][1] == second[2][1]
    assert [event for event, _, _ in first] == ["start", "term"]
    assert supervisor.children[1].restarts == 1
    assert second[2][2] < first[1][2], "stage 1 stops before stage 0"
    assert not any(alive(pid) for _, pid, _ in first + second)


def test_children_of_one_stage_stop_together(tmp_path: Path) -> None:
    # Each takes 1 s to stop; one after the other would take 3 s.
    slow_stop = (
        "note('start')\n"
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), note('term'), sys.exit(0)))\n"
        "time.sleep(60)\n"
    )
    supervisor = Supervisor(
        [python_child(f"child{i}", slow_stop, tmp_path, stop_stage=1) for i in range(3)]
    )
    signal_self_when(lambda: all(events(tmp_path, f"child{i}") for i in range(3)))
    assert supervisor.run() == 0
    terms = [events(tmp_path, f"child{i}")[-1][2] for i in range(3)]
    assert (max(terms) - min(terms)) / 1e9 < 0.8


def test_a_child_crashing_at_start_makes_the_supervisor_give_up(tmp_path: Path) -> None:
    supervisor = Supervisor(
        [python_child("broken", "note('start')\nsys.exit(1)\n", tmp_path)], restart_delay=0.01
    )
    assert supervisor.run() == 1
    assert len(events(tmp_path, "broken")) == MAX_QUICK_EXITS


def test_a_child_failing_on_its_configuration_is_never_restarted(tmp_path: Path) -> None:
    """Status 78 (EX_CONFIG) says a restart would fail the same way: not even a came-up child
    is restarted, and the supervisor ends with that status, stopping the others."""
    broken = f"note('start')\nsys.exit({EXIT_CONFIG})\n"
    supervisor = Supervisor(
        [python_child("broken", broken, tmp_path), python_child("steady", SLEEPER, tmp_path)],
        restart_delay=0.01,
        ready_probe=lambda: True,
    )
    with capture_logs() as logs:
        assert supervisor.run() == EXIT_CONFIG == os.EX_CONFIG
    assert len(events(tmp_path, "broken")) == 1
    assert all(child.process is None for child in supervisor.children)  # steady was stopped
    assert not any(entry["event"] == "restarting" for entry in logs)


def test_a_child_that_came_up_is_restarted_for_ever_with_a_capped_backoff(tmp_path: Path) -> None:
    # Up once (serve was ready with it running), then crashing at once on every restart.
    marker = tmp_path / "ran-once"
    flaky = (
        "note('start')\n"
        f"if not os.path.exists({str(marker)!r}):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    time.sleep(1.5)\n"
        "sys.exit(1)\n"
    )
    supervisor = Supervisor(
        [python_child("flaky", flaky, tmp_path), python_child("steady", SLEEPER, tmp_path)],
        restart_delay=0.01,
        max_restart_delay=0.08,
        ready_probe=lambda: True,
    )
    starts = 3 * MAX_QUICK_EXITS
    signal_self_when(lambda: len(events(tmp_path, "flaky")) >= starts, timeout=60)
    with capture_logs() as logs:
        assert supervisor.run() == 0, "a crash loop of one child must not end the supervisor"
    assert len(events(tmp_path, "flaky")) >= starts
    assert [event for event, _, _ in events(tmp_path, "steady")] == ["start", "term"]
    delays = [entry["in_s"] for entry in logs if entry["event"] == "restarting"]
    assert len(delays) >= starts - 1
    assert delays[:3] == [0.02, 0.04, 0.08]  # doubling with each quick death...
    assert max(delays) == 0.08 and delays[-1] == 0.08  # ...up to the cap
    assert any(entry["event"] == "not ready: a child is down" for entry in logs)


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    stubborn = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nnote('start')\ntime.sleep(60)\n"
    supervisor = Supervisor([python_child("stubborn", stubborn, tmp_path)], stop_timeout=0.5)
    signal_self_when(lambda: bool(events(tmp_path, "stubborn")))
    started = time.monotonic()
    assert supervisor.run() == 0
    assert time.monotonic() - started < 10
    ((_, pid, _),) = events(tmp_path, "stubborn")
    assert not alive(pid)


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from loomserve.cli.supervisor import ChildSpec, Supervisor
        code = "import os, time; open('child.pid', 'w').write(str(os.getpid())); time.sleep(60)"
        Supervisor([ChildSpec("sleeper", [sys.executable, "-c", code], dict(os.environ))]).run()
        """
    )
    supervisor = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    pid_file = tmp_path / "child.pid"
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert alive(child)
    supervisor.kill()
    supervisor.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


@pytest.mark.parametrize(
    ("returncode", "text"), [(0, "exit 0"), (3, "exit 3"), (-9, "killed by SIGKILL")]
)
def test_describe_returncode(returncode: int, text: str) -> None:
    assert describe_returncode(returncode) == text


def test_serve_survives_seven_quick_worker_kills_and_answers_after(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(tiny_model_path)]
    argv += ["--port", str(port), "--slots", "2", "--ctx-size", "256", "--threads", "1"]
    argv += ["--worker-timeout", "1", "--heartbeat-interval", "0.25", "--log-json"]
    argv += ["--max-restart-delay", "1"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, cwd=ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT
        )
    served = Served(process, f"http://127.0.0.1:{port}", port, log_path)

    def worker_pid() -> int | None:
        pids = [p for p, c in children_of(process.pid).items() if role(c) == "worker"]
        return pids[0] if pids else None

    try:
        # Ready as the supervisor sees it: from then on a crash is retried, never fatal.
        wait_until(lambda: "ready" in events_of(served), 90, "serve never became ready", served)
        killed: list[int] = []
        new_pid: list[int] = []

        def restarted() -> bool:
            # One reading: the pid that passed the check is the one killed.
            pid = worker_pid()
            new_pid[:] = [pid] if pid not in (None, *killed) else []
            return bool(new_pid)

        for _ in range(7):
            wait_until(restarted, 30, "no new worker", served)
            with contextlib.suppress(ProcessLookupError):
                os.kill(new_pid[0], signal.SIGKILL)
            killed.append(new_pid[0])
        wait_until(served.healthy, 90, "serve did not recover from the kills", served)
        assert process.poll() is None, served.log_tail()
        for _ in range(5):
            response = served.completion(max_tokens=3)
            assert response.status_code == 200, response.text
        exits = [e for e in served.events() if e.get("event") == "child exited"]
        assert [e["child"] for e in exits] == ["worker"] * 7
        delays = [e["in_s"] for e in served.events() if e.get("event") == "restarting"]
        assert len(delays) == 7 and max(delays) == 1.0
        # Said again once the worker was back (the supervisor probes readiness periodically).
        wait_until(lambda: events_of(served).count("ready") >= 2, 10, "never ready again", served)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert process.returncode == 0, served.log_tail()


def events_of(served: Served) -> list[str]:
    return [entry.get("event", "") for entry in served.events()]
