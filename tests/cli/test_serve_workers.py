"""`loomserve serve --workers N` and `--gpus`: the plan's children, and two real workers served."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from loomserve.cli import serve as serving
from loomserve.cli.default_model import NamedModel
from loomserve.cli.main import main
from loomserve.worker.openmp import SHARED_CORES_WAIT
from tests.cli.test_cli import ROOT, children_of, clean_env, role
from tests.procs import free_port


def plan(**overrides: object) -> serving.ServePlan:
    options = {"threads": 3, "metrics_port": None, "slots": 2, "api_key": ()}
    values = {
        "models": (NamedModel("m", Path("m.gguf"), False),),
        "host": "127.0.0.1",
        "port": 8000,
        "gateways": 1,
        "options": options,
        **overrides,
    }
    return serving.ServePlan(**values)


def specs(serve_plan: serving.ServePlan, tmp_path: Path) -> list:
    endpoints = serving.model_endpoints(tmp_path, serve_plan)
    return serving.child_specs(
        serve_plan, endpoints, tmp_path, main.commands["worker"], main.commands["gateway"]
    )


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv) if word == flag]


def test_gpus_workers_and_threads_are_checked_and_derived() -> None:
    assert serving.parse_gpus(None) == ()
    assert serving.parse_gpus("0, 1") == ("0", "1")
    for bad in ("0,,1", "1,1", ""):
        with pytest.raises(ValueError):
            serving.parse_gpus(bad)
    assert serving.worker_count(None, ()) == 1
    assert serving.worker_count(None, ("0", "1")) == 2
    assert serving.worker_count(3, ()) == 3
    with pytest.raises(ValueError, match="one worker per GPU"):
        serving.worker_count(3, ("0", "1"))
    assert serving.threads_per_worker(0, 1) == 0  # one worker: llama.cpp takes every core
    assert serving.threads_per_worker(5, 2) == 5  # as given
    cores = len(os.sched_getaffinity(0))
    assert serving.threads_per_worker(0, 2) == max(1, cores // 2)
    assert serving.threads_per_worker(0, 4 * cores) == 1


def test_each_worker_gets_its_socket_gpu_and_metrics_port(tmp_path: Path) -> None:
    children = specs(
        plan(workers=2, gpus=("1", "3"), options={"threads": 3, "metrics_port": 9100}), tmp_path
    )
    workers, gateway = children[:2], children[2]
    assert [w.name for w in workers] == ["worker-1", "worker-2"]
    binds = [flag_values(list(w.argv), "--bind")[0] for w in workers]
    assert binds == [f"ipc://{tmp_path}/worker-1.ipc", f"ipc://{tmp_path}/worker-2.ipc"]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["1", "3"]
    assert [flag_values(list(w.argv), "--metrics-port") for w in workers] == [["9100"], ["9101"]]
    assert [flag_values(list(w.argv), "--threads") for w in workers] == [["3"], ["3"]]
    assert flag_values(list(gateway.argv), "--worker") == binds
    assert gateway.stop_stage > workers[0].stop_stage
    # One worker keeps its plain name and socket, and the environment's GPUs.
    (single, _) = specs(plan(), tmp_path)
    assert single.name == "worker" and flag_values(list(single.argv), "--bind") == [
        f"ipc://{tmp_path}/worker.ipc"
    ]
    assert single.env.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_serve_with_two_workers_routes_to_both(tiny_model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(tiny_model_path)]
    argv += ["--port", str(port), "--workers", "2", "--slots", "1", "--ctx-size", "256"]
    argv += ["--heartbeat-interval", "0.25", "--worker-timeout", "1", "--log-json"]
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, cwd=ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).json().get("workers_ready") == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        children = children_of(process.pid)
        assert sorted(role(c) for c in children.values()) == ["gateway", "worker", "worker"]
        # --threads 0 (the default) split between the two workers.
        cores = len(os.sched_getaffinity(0))
        for cmdline in (c for c in children.values() if role(c) == "worker"):
            assert flag_values(cmdline, "--threads") == [str(max(1, cores // 2))]
        body = {"prompt": "hello world", "max_tokens": 16, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(
                    lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(4)
                )
            )
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        routed = [
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(url + "/metrics").text.splitlines()
            if line.startswith("loomserve:worker_requests_routed_total{")
        ]
        assert len(routed) == 2 and min(routed) > 0, routed  # one slot each: both served
    finally:
        process.terminate()
        assert process.wait(30) == 0, log_path.read_text()[-3000:]


def test_workers_that_share_the_cores_wait_passively(tmp_path: Path, monkeypatch) -> None:
    """libgomp's own spin where the workers' threads fit the cores; passive waiting where the
    workers that may run at once have more threads than there are cores (worker/openmp.py);
    a user's own setting always."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(serving, "_cores", lambda: 4)
    two = (NamedModel("a", Path("a.gguf"), True), NamedModel("b", Path("b.gguf"), True))

    def waits(serve_plan: serving.ServePlan) -> set[str | None]:
        children = specs(serve_plan, tmp_path)
        gateways = [c for c in children if c.name.startswith("gateway")]
        assert {c.env.get("OMP_WAIT_POLICY") for c in gateways} == {None}
        workers = [c for c in children if c.name.startswith("worker")]
        assert {c.env.get("GOMP_SPINCOUNT") for c in workers} == {os.environ.get("GOMP_SPINCOUNT")}
        return {c.env.get("OMP_WAIT_POLICY") for c in workers}

    passive = {SHARED_CORES_WAIT["OMP_WAIT_POLICY"]}
    assert waits(plan(options={"threads": 0})) == {None}  # one worker, every core
    assert waits(plan(workers=2, options={"threads": 2})) == {None}  # serve's split
    assert waits(plan(workers=2, options={"threads": 4})) == passive
    assert waits(plan(models=two, models_max=2, options={"threads": 0})) == passive
    assert waits(plan(models=two, models_max=1, options={"threads": 0})) == {None}
    monkeypatch.setenv("GOMP_SPINCOUNT", "INFINITE")
    assert waits(plan(workers=2, options={"threads": 4})) == {None}  # the user's, kept


def test_each_models_worker_gets_its_own_projector(tmp_path: Path) -> None:
    two = (
        NamedModel("vision", Path("vision.gguf"), False, Path("mmproj-vision.gguf")),
        NamedModel("text", Path("text.gguf"), False),
    )
    workers = {
        child.name: child.argv
        for child in specs(plan(models=two), tmp_path)
        if child.name.startswith("worker")
    }
    assert flag_values(workers["worker-vision"], "--mmproj") == ["mmproj-vision.gguf"]
    assert flag_values(workers["worker-text"], "--mmproj") == []
