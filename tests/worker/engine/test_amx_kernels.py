"""`--no-batch-invariant` on the default model (Gemma 3 270M, Q4_K_M) decodes on any CPU.

Where pip built llama.cpp for a CPU with AMX, its AMX kernels take quantized weights put in
extra buffer types and crash the process in ggml_backend_amx_mul_mat (llama.cpp #20824); the
engine then keeps the weights as loaded. The decode runs in a child process, since the crash
is a segfault that would take pytest down with it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from loomserve.cli.default_model import default_model_path
from loomserve.worker.engine.engine import amx_kernels

pytestmark = pytest.mark.default_model

DECODE = """
import sys
from pathlib import Path
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine

config = WorkerConfig(model_path=Path(sys.argv[1]), slots=2, ctx_size=128, threads=2,
                      batch_tokens=64, max_queue=2, batch_invariant=False)
engine = Engine(config)
engine.batch.clear()
engine.batch.add_run([2, 651, 6290, 529], 0, 0, logits_on_last=True)
assert engine.decode(engine.batch) == 0
print("token", int(engine.output_logits(1)[0].argmax()))
"""


def test_the_default_model_decodes_with_repacked_weights_allowed():
    done = subprocess.run(
        [sys.executable, "-c", DECODE, str(default_model_path())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("token ")  # after the engine's log lines
    # On a build with the AMX kernels the engine said why its weights are not repacked.
    assert ("llama.cpp #20824" in done.stdout + done.stderr) == amx_kernels()
