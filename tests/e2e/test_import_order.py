"""The worker and gateway processes load llama.cpp's shared libraries before any other
extension module.

A CUDA build of llama.cpp crashed in llama_model_load_from_file in a worker that had loaded
numpy, msgpack and others before libllama (on an H200, 2026-11-26; an earlier GPU saw it with
zmq first); with llama_cpp imported first it served. CPU CI cannot reproduce the crash, but it
can check the order: an audit hook records when ctypes loads libllama and when the
third-party modules with native code are first imported, in the real `loomserve worker` and
`loomserve gateway` start-up path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from loomserve.worker.openmp import SPIN_COUNT
from tests.procs import REPO_ROOT

RECORDER = r"""
import json, os, runpy, sys
seen, spin = [], []

def hook(event, args):
    if event == "import" and args[0] in ("zmq", "numpy", "msgpack", "structlog", "click"):
        seen.append("import " + args[0])
    elif event == "ctypes.dlopen" and "libllama" in str(args[0]):
        seen.append("load libllama")
        spin.append(os.environ.get("GOMP_SPINCOUNT"))

sys.addaudithook(hook)
sys.argv = ["loomserve", sys.argv[1], "--model", "/nonexistent/model.gguf"]
try:
    runpy.run_module("loomserve.cli.main", run_name="__main__")
except BaseException:  # no model here: what matters is what was imported on the way
    pass
print("ORDER " + json.dumps(seen))
print("SPIN " + json.dumps(spin))
"""


@pytest.mark.parametrize("command", ["worker", "gateway"])
def test_libllama_is_loaded_before_zmq_is_imported(command: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", RECORDER, command],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    line = next(x for x in result.stdout.splitlines() if x.startswith("ORDER "))
    seen = json.loads(line.removeprefix("ORDER "))
    assert "import zmq" in seen and "load libllama" in seen, (seen, result.stderr[-2000:])
    assert seen[0] == "load libllama", seen


@pytest.mark.parametrize(
    ("environment", "spin"),
    [
        ({}, SPIN_COUNT),
        ({"GOMP_SPINCOUNT": "INFINITE"}, "INFINITE"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, None),
    ],
)
def test_openmp_spin_is_set_before_libgomp_loads(environment: dict, spin: str | None) -> None:
    """worker/openmp.py's short spin is in the environment when libllama (and with it
    libgomp, which reads it once) is loaded; a user's own OpenMP settings are kept."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    result = subprocess.run(
        [sys.executable, "-c", RECORDER, "worker"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env={**env, **environment},
    )  # fmt: skip
    line = next(x for x in result.stdout.splitlines() if x.startswith("SPIN "))
    assert json.loads(line.removeprefix("SPIN ")) == [spin], result.stderr[-2000:]
