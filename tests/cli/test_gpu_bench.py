"""benchmarks/gpu_bench.py on a CPU, with small settings: every sampling load runs on one
server and lands in the JSON and the table under its own name."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from loomserve.worker.engine import kernels
from loomserve.worker.sampling import rowscan
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


def test_the_gpu_session_script_goes_past_its_build(tmp_path: Path) -> None:
    """benchmarks/gpu_session.sh with a kit whose build does nothing and no measurements:
    it reaches its measurements and ends. (A bare `wait` once waited on the script's own
    `tee` for good, and the lent machine's whole call ran out in it.)"""
    kit = tmp_path / ".gpu"
    (kit / "whl").mkdir(parents=True)
    (kit / "build.sh").write_text("echo built\n")
    (kit / "env.sh").write_text("true\n")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    env = {
        "PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "MODEL": str(model),
        "STEPS": "none", "LINKS": str(tmp_path / "links"),
    }  # fmt: skip
    script = REPO_ROOT / "benchmarks" / "gpu_session.sh"
    result = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    log = (tmp_path / "out" / "session.log").read_text()
    assert "built" in log and "=== build and model at" in log
    assert (tmp_path / "links" / "loomserve" / "worker").is_symlink()


def test_the_gpu_session_script_builds_the_whole_c_libraries(tmp_path: Path) -> None:
    """pip does not run on the lent machine, so the script builds the worker's two C
    libraries with gcc itself: from every C source pyproject.toml's extensions list (it once
    left out graphdraw.c, and rowscan.library() would have failed there on the missing
    symbols)."""
    script = (REPO_ROOT / "benchmarks" / "gpu_session.sh").read_text()
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    extensions = {e["name"]: e for e in project["tool"]["setuptools"]["ext-modules"]}
    built_by = {
        "loomserve.worker.sampling._sampling": ("sampling", "worker/sampling/_sampling", rowscan),
        "loomserve.worker.engine._kernels": ("kernels", "worker/engine/_kernels", kernels),
    }
    assert set(extensions) == set(built_by)
    for name, (folder, target, binding) in built_by.items():
        assert f'-o "{target}$suffix" csrc/{folder}/*.c -lm -ldl' in script
        sources = sorted(
            str(p.relative_to(REPO_ROOT)) for p in REPO_ROOT.glob(f"csrc/{folder}/*.c")
        )
        assert sources == sorted(extensions[name]["sources"])
        library = tmp_path / f"{folder}.so"
        command = ["gcc", "-O3", "-shared", "-fPIC", "-Icsrc/include", "-o", str(library)]
        subprocess.run([*command, *sources, "-lm", "-ldl"], cwd=REPO_ROOT, check=True, timeout=120)
        built = ctypes.CDLL(str(library))
        assert all(hasattr(built, function) for function in binding._SIGNATURES)
