"""serve's record of its workers (cli/serve_registry.py) and the commands that read it,
without an engine: written for the block's length and removed after, a dead serve's record
skipped, and `worker-health` judging serve's workers (one loaded on demand may be down)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from loomserve.cli.main import main
from loomserve.cli.serve_registry import ServeRecord, registered, running, runtime_dir


def test_a_record_lives_as_long_as_its_block(tmp_path: Path) -> None:
    record = ServeRecord(os.getpid(), "http://127.0.0.1:8000", {"a": ["ipc:///x/worker.ipc"]})
    with registered(record, tmp_path) as path:
        [found] = running(tmp_path)
        assert found.endpoints() == ["ipc:///x/worker.ipc"]
        assert found.url == "http://127.0.0.1:8000" and not found.on_demand
        assert path.exists()
    assert not path.exists()
    assert running(tmp_path) == []


def test_a_dead_serves_record_is_skipped(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    body = {"pid": gone.pid, "url": "http://127.0.0.1:1", "models": {"a": ["ipc:///gone"]}}
    (tmp_path / f"serve-{gone.pid}.json").write_text(json.dumps(body))
    (tmp_path / "serve-half.json").write_text("{")  # being written: not a record yet
    assert running(tmp_path) == []


def test_the_runtime_dir_is_the_users_own() -> None:
    assert runtime_dir({"LOOMSERVE_RUNTIME_DIR": "/r"}) == Path("/r")
    assert runtime_dir({"XDG_RUNTIME_DIR": "/run/user/7"}) == Path("/run/user/7/loomserve")
    assert runtime_dir({}).name.startswith("loomserve-")


@pytest.mark.parametrize("on_demand", [False, True])
def test_worker_health_fails_when_serves_workers_do_not_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_demand: bool
) -> None:
    """A worker of a serve that does not answer fails the check; under a model manager it is
    a model not loaded now, said as such, and the check fails only because none is ready."""
    monkeypatch.setenv("LOOMSERVE_RUNTIME_DIR", str(tmp_path))
    endpoint = f"ipc://{tmp_path / 'nothing.ipc'}"
    record = ServeRecord(os.getpid(), "http://127.0.0.1:1", {"a": [endpoint]}, on_demand)
    with registered(record, tmp_path):
        result = CliRunner().invoke(main, ["worker-health", "--timeout", "0.2"])
        listed = CliRunner().invoke(main, ["workers"])
    assert result.exit_code == 1, result.output
    said = "not running (its model is not loaded now)" if on_demand else "no answer"
    assert f"{endpoint}: {said}" in result.output
    assert listed.exit_code == 0 and f"a: {endpoint}" in listed.output


def test_workers_says_when_no_serve_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOMSERVE_RUNTIME_DIR", str(tmp_path))
    result = CliRunner().invoke(main, ["workers"])
    assert result.exit_code == 1
    assert "no loomserve serve is running" in result.output
