"""benchmarks/gpu_bench.py on a CPU, with small settings: every sampling load runs on one
server and lands in the JSON and the table under its own name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import REPO_ROOT


def test_each_load_is_measured_on_the_same_server(tiny_model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu-bench"
    command = [
        sys.executable, "-m", "benchmarks.gpu_bench", "--model", str(tiny_model_path),
        "--bin", str(tmp_path / "no-binaries"), "--only", "loomserve", "--loads", "greedy,topp",
        "--slots", "2", "--ctx-size", "128", "--input-len", "16", "--output-len", "4",
        "--concurrency", "2", "--prompts-per-stream", "1", "--gpu-layers", "0",
        "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((out / "gpu-bench.json").read_text())
    assert report["settings"]["loads"] == ["greedy", "topp"]
    by_load = report["results"]["loomserve"]
    for load in ("greedy", "topp"):
        summary = by_load[load]["2"]
        assert summary["completed"] == 8 and summary["failed"] == 0
        assert summary["total_output_tokens"] == 8 * 4  # ignore_eos: every token asked for
    assert len(list(out.glob("loomserve-*-c2.json"))) == 2
    table = (out / "gpu-bench.md").read_text()
    assert "| loomserve, greedy |" in table and "| loomserve, topp |" in table
    assert "topp: temperature 0.7, top_p 0.95" in table


@pytest.mark.parametrize(
    ("loads", "message"),
    [
        ("greedy,hot", "loads are among greedy, t1, topp"),
        ("greedy,t1,greedy", "each load once"),  # its results would replace the first run's
    ],
)
def test_bad_loads_are_refused_before_anything_starts(
    tiny_model_path: Path, loads: str, message: str
) -> None:
    command = [
        sys.executable, "-m", "benchmarks.gpu_bench", "--model", str(tiny_model_path),
        "--loads", loads,
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
