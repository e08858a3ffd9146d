"""--cpu-matmul: which of ggml's CPU kernels multiplies K-quant weights, and batch invariance.

ggml on its own takes its tiled matmul from 8 rows of a pass up and a dot product a row below,
summing in different orders, so a sequence's logits depend on how many others share its pass.
`dot` (the default with batch invariance) and `tiled` (the tiled matmul even for one row) each
use one kernel for every pass. ggml reads the choice from its environment once per process,
at its first matmul, so each case runs the default model (Gemma 3 270M, Q4_K_M) in a child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from loomserve.cli.default_model import default_model_path
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import cpu_matmul_environment, cpu_matmul_in_force

ROOT = Path(__file__).resolve().parents[3]

# One request alone, then with its 40-token prompt in chunks of 8, then beside twenty others:
# alone its prompt is one pass of 40 rows and its decodes passes of one; chunked, passes of 8;
# batched, its decodes share passes of 21 rows. Over ggml's threshold of 8 rows and on both
# of the tiled matmul's paths (up to 16 rows, and more). Prints its tokens and logprobs.
ALONE_AND_BATCHED = """
import json, sys
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from loomserve.protocol import Outputs
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.tick.loop import TickLoop
from tests.worker.engine.test_engine import GW, Collector, drain, greedy

config = WorkerConfig(model_path=Path(sys.argv[1]), slots=24, ctx_size=512, threads=2,
                      batch_tokens=512, max_queue=32, cpu_matmul=sys.argv[3])
engine = Engine(config)

def run(requests, config=config):
    collector = Collector()
    loop = TickLoop(engine, config, collector)
    for request in requests:
        loop.inbox.submit(GW, request)
    drain(loop)
    tokens, logprobs = [], []
    for outputs in collector.of_type(Outputs, GW):
        for chunk in outputs.tokens:
            if chunk.request_id == "a":
                tokens += chunk.token_ids
                logprobs += [entry.logprob for entry in chunk.logprobs]
    return {"tokens": tokens, "logprobs": logprobs}

a = greedy("a", [2] + [300 + 7 * j for j in range(40)], 24, ignore_eos=True, logprobs=1)
others = [greedy(f"o{i}", [2] + [100 + 37 * i + j for j in range(3 + i)], 24, ignore_eos=True)
          for i in range(20)]
print(json.dumps({"kernel": engine.cpu_matmul, "alone": run([a]),
                  "chunked": run([a], replace(config, prefill_chunk=8)),
                  "batched": run([a, *others])}))
"""


def alone_and_batched(cpu_matmul: str, **environment: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGML_CPU_TILED_MM")}
    done = subprocess.run(
        [sys.executable, "-c", ALONE_AND_BATCHED, str(default_model_path()), str(ROOT), cpu_matmul],
        capture_output=True,
        text=True,
        timeout=300,
        env=env | environment,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stdout + done.stderr


@pytest.mark.default_model
@pytest.mark.parametrize("cpu_matmul", ["dot", "tiled"])
def test_either_kernel_gives_a_sequence_the_same_logits_alone_and_batched(cpu_matmul):
    found, _ = alone_and_batched(cpu_matmul)
    assert found["kernel"] == cpu_matmul
    assert len(found["alone"]["logprobs"]) == 24
    assert found["chunked"] == found["alone"]  # tokens and logprobs, to the last bit
    assert found["batched"] == found["alone"]


@pytest.mark.default_model
def test_ggml_left_to_choose_by_the_rows_of_a_pass_is_not_batch_invariant():
    """What the two kernels above avoid, and what the engine says when the environment asks
    for it behind batch invariance's back (a user's GGML_CPU_TILED_MM wins)."""
    found, log = alone_and_batched("auto", GGML_CPU_TILED_MM="1")
    assert found["kernel"] == "ggml"
    assert found["batched"]["logprobs"] != found["alone"]["logprobs"]
    assert "greedy outputs can differ alone and batched" in log


def test_the_environment_each_choice_sets(tmp_path):
    config = WorkerConfig(model_path=tmp_path / "m.gguf")
    dot = {"GGML_CPU_TILED_MM": "0"}
    tiled = {"GGML_CPU_TILED_MM": "1", "GGML_CPU_TILED_MM_FORCE": "1"}
    assert cpu_matmul_environment(config) == dot  # batch-invariant by default
    assert cpu_matmul_environment(replace(config, batch_invariant=False)) == {}  # ggml's own
    for invariant in (True, False):
        assert cpu_matmul_environment(replace(config, cpu_matmul="dot")) == dot
        tiled_config = replace(config, cpu_matmul="tiled", batch_invariant=invariant)
        assert cpu_matmul_environment(tiled_config) == tiled
    with pytest.raises(ValueError, match="cpu_matmul must be one of auto, dot, tiled"):
        replace(config, cpu_matmul="tiles")


@pytest.mark.parametrize(
    ("environment", "kernel"),
    [
        ({}, "ggml"),
        ({"GGML_CPU_TILED_MM": "0"}, "dot"),
        ({"GGML_CPU_TILED_MM": "off"}, "dot"),  # C's atoi: 0, as ggml reads it
        ({"GGML_CPU_TILED_MM": "1"}, "ggml"),
        ({"GGML_CPU_TILED_MM_FORCE": "1"}, "tiled"),
        ({"GGML_CPU_TILED_MM": " 2", "GGML_CPU_TILED_MM_FORCE": "01"}, "tiled"),
        ({"GGML_CPU_TILED_MM": "0", "GGML_CPU_TILED_MM_FORCE": "1"}, "dot"),
    ],
)
def test_the_kernel_in_force_is_read_as_ggml_reads_it(monkeypatch, environment, kernel):
    for name in ("GGML_CPU_TILED_MM", "GGML_CPU_TILED_MM_FORCE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert cpu_matmul_in_force() == kernel
