"""`loomserve serve`: workers and gateways on one machine, the gateways sharing one HTTP port.

Each worker listens on an ipc:// socket in a private temp dir and every gateway connects to
all of them (pool.py routes between them); with --gpus each worker sees only its own GPU.
Each gateway binds the HTTP port itself with SO_REUSEPORT, so the kernel spreads connections
across them. The gateways share a Prometheus multiprocess dir in the same temp dir, so any
gateway's /metrics counts them all.
"""

from __future__ import annotations

import http.client
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import structlog

from loomserve.cli.supervisor import Child, ChildSpec, Supervisor

log = structlog.get_logger(__name__)

# Passed to the children through their environment, not their argv, where `ps` would show them.
SECRET_OPTIONS = frozenset({"api_key"})


@dataclass(frozen=True, slots=True)
class ServePlan:
    """What serve starts: the children's settings, fixed before the first one runs."""

    model: Path
    host: str
    port: int
    gateways: int
    options: Mapping[str, Any]  # option values by name, for the worker's and gateways' commands
    max_restart_delay: float = 30.0  # the cap on the doubling delay before a restart
    workers: int = 1
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES of each worker, when given


def parse_gpus(text: str | None) -> tuple[str, ...]:
    """The device ids of --gpus ("0,1" -> ("0", "1")); raises ValueError on a bad list."""
    if text is None:
        return ()
    devices = tuple(part.strip() for part in text.split(","))
    if not all(devices):
        raise ValueError(f"--gpus {text!r}: give device ids separated by commas, like 0,1")
    if len(set(devices)) != len(devices):
        raise ValueError(f"--gpus {text!r} names a GPU twice; one worker per GPU")
    return devices


def worker_count(workers: int | None, gpus: tuple[str, ...]) -> int:
    """How many workers to run: --workers, else one per GPU, else 1."""
    if gpus and workers is not None and workers != len(gpus):
        raise ValueError(f"--workers {workers} with {len(gpus)} --gpus: one worker per GPU")
    return workers or len(gpus) or 1


def threads_per_worker(threads: int, workers: int) -> int:
    """--threads for each worker: as given, or (0: all cores) the cores split between them."""
    if threads or workers == 1:
        return threads
    return max(1, _cores() // workers)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may use (containers, taskset)
    except AttributeError:
        return os.cpu_count() or 1


def serve(plan: ServePlan, worker_command: click.Command, gateway_command: click.Command) -> int:
    """Run the plan under a supervisor until SIGINT/SIGTERM; the exit status."""
    workdir = Path(tempfile.mkdtemp(prefix="loomserve-"))
    try:
        endpoints = worker_endpoints(workdir, plan.workers)
        metrics_dir = workdir / "prometheus"
        metrics_dir.mkdir()
        children = child_specs(plan, endpoints, metrics_dir, worker_command, gateway_command)
        url = f"http://{_url_host(plan.host)}:{plan.port}"
        log.info(
            "starting",
            url=url,
            gateways=plan.gateways,
            workers=endpoints,
            gpus=list(plan.gpus) or None,
            threads=plan.options.get("threads"),
            model=str(plan.model),
        )

        def on_exit(child: Child, pid: int) -> None:
            if child.spec.name.startswith("gateway"):
                _forget_gateway_metrics(pid, metrics_dir)

        supervisor = Supervisor(
            children,
            ready_probe=lambda: health_ok(_probe_host(plan.host), plan.port),
            on_ready=lambda: log.info("ready", url=url, openai_base_url=f"{url}/v1"),
            on_exit=on_exit,
            max_restart_delay=plan.max_restart_delay,
            # Each stage drains for shutdown_timeout first; SIGKILL only after that.
            stop_timeout=float(plan.options.get("shutdown_timeout", 5.0)) + 10.0,
        )
        return supervisor.run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def worker_endpoints(workdir: Path, count: int) -> list[str]:
    """The ipc:// endpoint of each worker, in the private temp dir."""
    if count == 1:
        return [f"ipc://{workdir / 'worker.ipc'}"]
    return [f"ipc://{workdir / f'worker-{index}.ipc'}" for index in range(1, count + 1)]


def child_specs(
    plan: ServePlan,
    endpoints: list[str],
    metrics_dir: Path,
    worker_command: click.Command,
    gateway_command: click.Command,
) -> list[ChildSpec]:
    """The workers, then the gateways; on the way down, the gateways stop first."""
    workers = []
    for index, endpoint in enumerate(endpoints):
        values = {**plan.options, "model": str(plan.model), "bind": endpoint}
        if values.get("metrics_port") is not None:
            values["metrics_port"] += index  # one port each: the given one, then the next
        extra = {"CUDA_VISIBLE_DEVICES": plan.gpus[index]} if plan.gpus else None
        name = "worker" if len(endpoints) == 1 else f"worker-{index + 1}"
        workers.append(
            ChildSpec(
                name=name,
                argv=child_argv(worker_command, values),
                env=child_env(plan.options, drop=("PROMETHEUS_MULTIPROC_DIR",), extra=extra),
            )
        )
    gateway_values = {
        **plan.options,
        "model": str(plan.model),
        "worker_endpoint": tuple(endpoints),
        "host": plan.host,
        "port": plan.port,
        "reuse_port": True,
    }
    gateway_env = child_env(plan.options, extra={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)})
    gateways = [
        ChildSpec(
            f"gateway-{index}",
            child_argv(gateway_command, gateway_values),
            gateway_env,
            stop_stage=1,  # before the worker, so open streams can end
        )
        for index in range(1, plan.gateways + 1)
    ]
    return [*workers, *gateways]


def child_argv(command: click.Command, values: Mapping[str, Any]) -> list[str]:
    """`python -m loomserve.cli.main <command> --opt value ...` for the options the command has.

    Every value goes on the command line, defaults included: the child inherits the
    environment, and an env var there must not override what serve was told.
    """
    argv = [sys.executable, "-P", "-m", "loomserve.cli.main", str(command.name)]
    for param in command.params:
        if not isinstance(param, click.Option) or param.name not in values:
            continue
        if param.name in SECRET_OPTIONS:
            continue
        argv += render_option(param, values[param.name])
    return argv


def render_option(option: click.Option, value: Any) -> list[str]:
    """The command-line words that give `option` this value."""
    flag = max(option.opts, key=len)
    if value is None:
        return []
    if option.is_flag:
        if value:
            return [flag]
        return [max(option.secondary_opts, key=len)] if option.secondary_opts else []
    if option.multiple:
        return [word for item in value for word in (flag, str(item))]
    return [flag, str(value)]


def child_env(
    values: Mapping[str, Any],
    drop: tuple[str, ...] = (),
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The supervisor's environment (children import loomserve as it does), plus secrets."""
    env = {key: value for key, value in os.environ.items() if key not in drop}
    for name in SECRET_OPTIONS & values.keys():
        # One a line: a key has no whitespace (ApiKey), so no key can be split.
        env[f"LOOMSERVE_{name.upper()}"] = "\n".join(values[name] or ())
    env.update(extra or {})
    return env


def health_ok(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether GET /health on host:port answers 200."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def _forget_gateway_metrics(pid: int, metrics_dir: Path) -> None:
    """Drop a dead gateway's live gauges from the shared multiprocess dir."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(metrics_dir))


def _probe_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _url_host(host: str) -> str:
    shown = _probe_host(host)
    return f"[{shown}]" if ":" in shown else shown
