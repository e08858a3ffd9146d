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
import subprocess
import sys

import pytest

from tests.procs import REPO_ROOT

RECORDER = r"""
import json, os, runpy, sys
seen = []

def hook(event, args):
    if event == "import" and args[0] in ("zmq", "numpy", "msgpack", "structlog", "click"):
        seen.append("import " + args[0])
    elif event == "ctypes.dlopen" and "libllama" in str(args[0]):
        seen.append("load libllama")

sys.addaudithook(hook)
sys.argv = ["loomserve", sys.argv[1], "--model", "/nonexistent/model.gguf"]
try:
    runpy.run_module("loomserve.cli.main", run_name="__main__")
except BaseException:  # no model here: what matters is what was imported on the way
    pass
print("ORDER " + json.dumps(seen))
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
