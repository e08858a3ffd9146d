"""benchmarks/bench_single_stream.py: its readings of the servers' own logs and of /proc, and
a run against loomserve serving the tiny model (no llama-server: loomserve's figures alone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_single_stream import (
    cpu_between,
    llama_server_steps,
    loomserve_steps,
    process_tree_cpu,
    role,
)
from tests.procs import REPO_ROOT


def test_the_tick_log_splits_prompt_ticks_from_decode_ticks(tmp_path: Path) -> None:
    log = tmp_path / "loom.log"
    log.write_text(
        '{"event": "starting", "level": "info"}\n'
        '{"tick": 1, "prefill_tokens": 40, "decode_tokens": 0, "tick_ms": 150.5, "event": "tick"}\n'
        '{"tick": 2, "prefill_tokens": 0, "decode_tokens": 1, "tick_ms": 17.25, "event": "tick"}\n'
        "not json: a stray line\n"
        '{"tick": 3, "prefill_tokens": 0, "decode_tokens": 1, "tick_ms": 18.0, "event": "tick"}\n'
    )
    assert loomserve_steps(log) == ([150.5], [17.25, 18.0])


def test_llama_servers_timings_give_its_prompt_pass_and_its_step(tmp_path: Path) -> None:
    log = tmp_path / "llama.log"
    log.write_text(
        "slot print_timing: id 15 | task 0 | prompt eval time =     174.46 ms /    52 tokens "
        "(    3.36 ms per token,   298.06 tokens per second)\n"
        "slot print_timing: id 15 | task 0 |        eval time =    1072.00 ms /    64 tokens "
        "(   16.75 ms per token,    59.70 tokens per second)\n"
        "slot print_timing: id 15 | task 0 |       total time =    1246.46 ms /   116 tokens\n"
    )
    prompts, steps = llama_server_steps(log)
    assert prompts == [174.46]
    assert steps == [1072.0 / 64]


def test_cpu_is_summed_by_role_between_two_readings() -> None:
    before = {10: ("loomserve worker", 1.0, 0.5), 11: ("loomserve gateway", 0.2, 0.1)}
    after = {
        10: ("loomserve worker", 3.0, 0.75),
        11: ("loomserve gateway", 0.5, 0.1),
        12: ("loomserve gateway", 0.25, 0.0),  # started between the readings
    }
    used = cpu_between(before, after)
    assert used["loomserve worker"] == (2.0, 0.25)
    assert used["loomserve gateway"] == (0.55, 0.0)


def test_roles_and_the_process_tree_of_this_process() -> None:
    assert role(["/opt/llama-server", "-m", "x"]) == "llama-server"
    assert role(["python", "-m", "loomserve.cli.main", "gateway", "--port", "1"]) == (
        "loomserve gateway"
    )
    assert role(["python", "-m", "loomserve.cli.main", "serve"]) == "loomserve supervisor"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = process_tree_cpu(os.getpid())
        assert os.getpid() in tree and child.pid in tree
        assert all(user >= 0 and system >= 0 for _, user, system in tree.values())
    finally:
        child.kill()
        child.wait()


def test_a_run_against_loomserve_alone(tiny_model_path: Path, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "benchmarks.bench_single_stream", "--model", str(tiny_model_path),
        "--rounds", "1", "--requests", "2", "--tokens", "8", "--prompt-words", "4",
        "--threads", "1", "--llama-server", str(tmp_path / "no-llama-server"),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if " | " in line]
    figures = next(row for row in rows if row[0] == "loomserve" and len(row) == 6)
    rate, ttft, per_token, prompt_pass, step = map(float, figures[1:])
    assert rate > 0 and ttft > 0 and per_token > 0 and prompt_pass > 0 and step > 0
    processes = {row[1] for row in rows if len(row) == 3}
    assert {"loomserve worker", "loomserve gateway", "client (this process)"} <= processes
