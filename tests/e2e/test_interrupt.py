"""Ctrl-C stops a test run: pytest prints its summary and exits 2, and no server a test
started lives on after it (tests/procs.py kills what is left when the process exits), even
one a test had started without a `with` to stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.procs import REPO_ROOT

INNER = """
import os, time
from pathlib import Path
from tests.procs import start_worker


def test_holds_a_worker():
    worker = start_worker(Path(os.environ["TINY_MODEL"]), wait=False)
    Path(os.environ["PID_FILE"]).write_text(str(worker.pid))
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_stops_the_run_with_its_summary_and_no_server_left(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    (tmp_path / "test_inner.py").write_text(INNER)
    pid_file = tmp_path / "worker.pid"
    env = {**os.environ, "TINY_MODEL": str(tiny_model_path), "PID_FILE": str(pid_file)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    run = subprocess.Popen(
        [*command, str(tmp_path / "test_inner.py")],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As a terminal's Ctrl-C finds it: SIGINT at its default (a shell's background job
        # would have it ignored), so Python turns it into KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert run.poll() is None, run.communicate()[0]
            assert time.monotonic() < deadline, "the inner test never started its worker"
            time.sleep(0.05)
        worker = int(pid_file.read_text())
        run.send_signal(signal.SIGINT)
        output, _ = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 2, output  # pytest's "interrupted"
    assert "KeyboardInterrupt" in output and "no tests ran in" in output, output
    deadline = time.monotonic() + 60
    while _alive(worker):  # killed at the inner run's exit; init reaps it
        assert time.monotonic() < deadline, f"worker {worker} outlived the interrupted run"
        time.sleep(0.05)
