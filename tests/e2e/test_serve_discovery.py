"""serve's workers are found without reading its log (issue 60, item 10), on the real
engine: the `ready` line names their ipc:// endpoints, `loomserve workers` lists them, and
`loomserve worker-health` without --worker probes them; once serve stops, none is listed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_models import wait_until
from tests.e2e.test_serve_models import events
from tests.procs import REPO_ROOT, Proc, free_port, wait_http


def _cli(runtime: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loomserve.cli.main", *args],
        cwd=REPO_ROOT,
        env=_env(runtime),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _env(runtime: Path) -> dict[str, str]:
    return {**os.environ, "LOOMSERVE_RUNTIME_DIR": str(runtime)}


def test_serves_workers_are_listed_and_probed(tiny_model_path: Path, tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    port = free_port()
    args = ["serve", "--model", str(tiny_model_path), "--port", str(port), "--workers", "2"]
    args += ["--slots", "2", "--ctx-size", "512", "--threads", "1", "--log-json"]
    args += ["--heartbeat-interval", "0.25", "--worker-timeout", "2"]
    with Proc("serve", args, env={"LOOMSERVE_RUNTIME_DIR": str(runtime)}) as serve:
        serve.url = f"http://127.0.0.1:{port}"
        wait_http(serve, "/health")
        wait_until(lambda: bool(events(serve, "ready")), "serve to say it is ready")
        [ready] = events(serve, "ready")
        [(model, endpoints)] = ready["workers"].items()
        assert len(endpoints) == 2 and all(e.startswith("ipc://") for e in endpoints), ready

        listed = _cli(runtime, "workers", "--json")
        assert listed.returncode == 0, listed.stderr
        [record] = [json.loads(line) for line in listed.stdout.splitlines()]
        assert record["pid"] == serve.pid and record["url"] == serve.url
        assert record["models"] == {model: endpoints}

        health = _cli(runtime, "worker-health")
        assert health.returncode == 0, health.stdout + health.stderr
        for endpoint in endpoints:
            assert f"{endpoint}: ready:" in health.stdout, health.stdout

        serve.popen.send_signal(signal.SIGTERM)
        assert serve.popen.wait(60) == 0, serve.log_tail()
    gone = _cli(runtime, "workers")
    assert gone.returncode == 1 and "no loomserve serve is running" in gone.stderr
