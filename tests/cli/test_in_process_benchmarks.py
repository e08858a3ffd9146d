"""The in-process benchmarks run against the worker's current API (on the tiny model, with
the smallest settings): a benchmark that no longer starts would leave its figures in the docs
with nothing to re-measure them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import REPO_ROOT


def run_benchmark(*args: str) -> str:
    command = [sys.executable, "-m", *args]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def test_bench_worker_runs_the_engine_and_the_tick_loop(tiny_model_path: Path) -> None:
    out = run_benchmark(
        "benchmarks.bench_worker", "--model", str(tiny_model_path), "--sizes", "1,2",
        "--runs", "1", "--tokens", "4", "--threads", "1",
    )  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(float(row[1]) > 0 and float(row[2]) > 0 for row in rows)  # engine, worker tok/s


def test_bench_sampling_measures_every_setting_on_both_paths(tiny_model_path: Path) -> None:
    out = run_benchmark(
        "benchmarks.bench_sampling", "--model", str(tiny_model_path), "--slots", "2",
        "--reps", "1", "--ticks", "2", "--threads", "1", "--sampling-threads", "2",
    )  # fmt: skip
    assert "per tick at 2 generating slots" in out
    assert "per tick, host sampler, 2 sampling threads" in out
    for setting in ("greedy", "temperature 1", "temperature 0.7, top_p 0.95"):
        assert sum(line.startswith(setting) for line in out.splitlines()) == 5  # 3 + 1 + 1
    per_tick = [line.split() for line in out.splitlines() if line.startswith("greedy ")][3]
    assert len(per_tick) == 7  # host, draw and chains: outside and in llama_decode each


def test_bench_draw_churn_drains_both_loads_on_both_paths(tiny_model_path: Path) -> None:
    out = run_benchmark(
        "benchmarks.bench_draw_churn", "--model", str(tiny_model_path), "--slots", "2",
        "--requests", "4", "--tokens", "3", "--rounds", "1", "--threads", "1",
    )  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.startswith(("all drawn", "mixed"))]
    assert len(rows) == 2
    assert all(float(row[-1]) > 0 for row in rows)  # draw / host


@pytest.mark.parametrize("requests", ["2", "1,3"])
def test_bench_codec_times_each_outputs_size(requests: str) -> None:
    out = run_benchmark("benchmarks.bench_codec", "--requests", requests)
    sizes = [line.split()[0] for line in out.splitlines()[1:]]
    assert sizes == requests.split(",")
