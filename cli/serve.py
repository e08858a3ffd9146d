"""`loomserve serve`: workers and gateways on one machine, the gateways sharing one HTTP port.

Each worker listens on an ipc:// socket in a private temp dir and every gateway connects to
all of them (pool.py routes between them); with --gpus each worker sees only its own GPU.
With several models, each model has its workers, started and stopped on demand by the model
manager (models.py), which the gateways ask over a control socket in the same temp dir.
Each gateway binds the HTTP port itself with SO_REUSEPORT, so the kernel spreads connections
across them. The gateways share a Prometheus multiprocess dir in the same temp dir, so any
gateway's /metrics counts them all. While it runs, serve_registry.py's record names its
workers' endpoints (`loomserve workers`, `loomserve worker-health`).
"""

from __future__ import annotations

import http.client
import json
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

from ..gateway.http.middleware import READY_PROBE_AGENT
from ..worker.host_cpus import default_cpu_budget
from ..worker.openmp import wait_environment
from .default_model import MODELS_MAX, UNLOAD_DRAIN_SECONDS, NamedModel
from .models import ManagedModel, ModelManager
from .serve_registry import ServeRecord, registered
from .supervisor import Child, ChildSpec, Supervisor

log = structlog.get_logger(__name__)

# Passed to the children through their environment, not their argv, where `ps` would show them.
SECRET_OPTIONS = frozenset({"api_key"})


@dataclass(frozen=True, slots=True)
class ServePlan:
    """What serve starts: the children's settings, fixed before the first one runs."""

    models: tuple[NamedModel, ...]  # one: served as ever; several: loaded on demand
    host: str
    port: int
    gateways: int
    options: Mapping[str, Any]  # option values by name, for the worker's and gateways' commands
    max_restart_delay: float = 30.0  # the cap on the doubling delay before a restart
    workers: int = 1  # per model
    gpus: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES of each worker, when given
    models_max: int = MODELS_MAX
    idle_unload: float | None = None  # seconds
    unload_drain: float = UNLOAD_DRAIN_SECONDS  # seconds an unloading model's requests may take

    @property
    def managed(self) -> bool:
        """Whether a model manager runs: several models, a named one, or idle unloading."""
        named = any(model.named for model in self.models)
        return len(self.models) > 1 or named or self.idle_unload is not None

    @property
    def model(self) -> Path:
        return self.models[0].path


def gateway_models(models: list[NamedModel] | tuple[NamedModel, ...]) -> tuple[str, ...]:
    """The gateways' --model values: the file alone for one unnamed model (every worker
    serves it), NAME=PATH for each of several (a worker serves the one it is named for)."""
    if len(models) == 1 and not models[0].named:
        return (str(models[0].path),)
    return tuple(f"{model.name}={model.path}" for model in models)


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


def shares_cores(plan: ServePlan) -> bool:
    """Whether the threads of the workers that may run at once outnumber the cores: several
    models loaded together, or --threads above each worker's share (worker/openmp.py)."""
    at_once = plan.workers * min(len(plan.models), plan.models_max)
    return at_once * (plan.options.get("threads") or _cores()) > _cores()


def _cores() -> int:
    # What this process may keep busy: its affinity mask (cpusets, taskset), or its cgroup's
    # CPU quota (a container's CPU limit) where that is smaller.
    return default_cpu_budget().count


def serve(plan: ServePlan, worker_command: click.Command, gateway_command: click.Command) -> int:
    """Run the plan under a supervisor until SIGINT/SIGTERM; the exit status."""
    workdir = Path(tempfile.mkdtemp(prefix="loomserve-"))
    manager: ModelManager | None = None
    try:
        endpoints = model_endpoints(workdir, plan)
        control = f"ipc://{workdir / 'models.ipc'}" if plan.managed else None
        metrics_dir = workdir / "prometheus"
        metrics_dir.mkdir()
        children = child_specs(
            plan, endpoints, metrics_dir, worker_command, gateway_command, control
        )
        url = f"http://{_url_host(plan.host)}:{plan.port}"
        log.info(
            "starting",
            url=url,
            gateways=plan.gateways,
            workers=[e for each in endpoints for e in each],
            gpus=list(plan.gpus) or None,
            threads=plan.options.get("threads"),
            cpus=_cores(),
            cpus_from=default_cpu_budget().source,
            models={model.name: str(model.path) for model in plan.models},
            models_max=plan.models_max if plan.managed else None,
        )

        def on_exit(child: Child, pid: int) -> None:
            if child.spec.name.startswith("gateway"):
                _forget_gateway_metrics(pid, metrics_dir)

        by_model = {model.name: own for model, own in zip(plan.models, endpoints, strict=True)}
        default = plan.models[0].name if plan.managed else None
        supervisor = Supervisor(
            children,
            # Several models: ready once the default one (the first) serves, not before.
            ready_probe=lambda: health_ok(_probe_host(plan.host), plan.port, default),
            # The workers' endpoints too: they are in a private temp dir, found nowhere else
            # but here, `loomserve workers` and /slots.
            on_ready=lambda: log.info(
                "ready", url=url, openai_base_url=f"{url}/v1", workers=by_model
            ),
            on_exit=on_exit,
            max_restart_delay=plan.max_restart_delay,
            # Each stage drains for shutdown_timeout first; SIGKILL only after that.
            stop_timeout=float(plan.options.get("shutdown_timeout", 5.0)) + 10.0,
        )
        if control is not None:
            manager = _manager(plan, supervisor, endpoints, control)
            supervisor.on_poll = manager.poll
        record = ServeRecord(os.getpid(), url, by_model, on_demand=plan.managed)
        with registered(record):  # `loomserve workers` and `worker-health` find them
            return supervisor.run()
    finally:
        if manager is not None:
            manager.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _manager(
    plan: ServePlan, supervisor: Supervisor, endpoints: list[list[str]], control: str
) -> ModelManager:
    """The model manager over the supervisor's worker children; it loads the first model."""
    managed, first = [], 0
    for model, own in zip(plan.models, endpoints, strict=True):
        # child_specs lists each model's workers in turn, before the gateways.
        workers = supervisor.children[first : first + len(own)]
        first += len(own)
        managed.append(ManagedModel(model.name, model.path, workers, own))
    manager = ModelManager(
        supervisor, managed, control, plan.models_max, plan.idle_unload, plan.unload_drain
    )
    manager.load(plan.models[0].name)  # the default model: requests that name none get it
    return manager


def model_endpoints(workdir: Path, plan: ServePlan) -> list[list[str]]:
    """Each model's workers' ipc:// endpoints, in the private temp dir."""
    if len(plan.models) == 1:
        return [worker_endpoints(workdir, plan.workers)]
    return [
        worker_endpoints(workdir, plan.workers, prefix=f"model-{index}-")
        for index in range(1, len(plan.models) + 1)
    ]


def worker_endpoints(workdir: Path, count: int, prefix: str = "") -> list[str]:
    """The ipc:// endpoint of each worker, in the private temp dir."""
    if count == 1:
        return [f"ipc://{workdir / f'{prefix}worker.ipc'}"]
    return [f"ipc://{workdir / f'{prefix}worker-{index}.ipc'}" for index in range(1, count + 1)]


def child_specs(
    plan: ServePlan,
    endpoints: list[list[str]],
    metrics_dir: Path,
    worker_command: click.Command,
    gateway_command: click.Command,
    control: str | None = None,
) -> list[ChildSpec]:
    """The workers, then the gateways; on the way down, the gateways stop first. Under a
    model manager the workers start on demand."""
    workers = []
    numbered = 0
    spin = wait_environment(os.environ, shares_cores(plan))
    for model, own in zip(plan.models, endpoints, strict=True):
        for index, endpoint in enumerate(own):
            values = {**plan.options, "model": str(model.path), "bind": endpoint}
            if len(plan.models) > 1 or model.named:
                values["served_model_name"] = model.name  # the gateways place it by name
            if model.mmproj is not None:
                values["mmproj"] = str(model.mmproj)  # its own projector (--models-dir)
            if values.get("metrics_port") is not None:
                values["metrics_port"] += numbered  # one port each: the given one, the next...
            numbered += 1
            extra = {**spin, **({"CUDA_VISIBLE_DEVICES": plan.gpus[index]} if plan.gpus else {})}
            name = "worker" if len(own) == 1 else f"worker-{index + 1}"
            if len(plan.models) > 1:
                name = f"worker-{model.name}" + ("" if len(own) == 1 else f"-{index + 1}")
            workers.append(
                ChildSpec(
                    name=name,
                    argv=child_argv(worker_command, values),
                    env=child_env(plan.options, drop=("PROMETHEUS_MULTIPROC_DIR",), extra=extra),
                    on_demand=control is not None,
                )
            )
    gateway_values = {
        **plan.options,
        "model": gateway_models(plan.models),
        "worker_endpoint": tuple(e for own in endpoints for e in own),
        "host": plan.host,
        "port": plan.port,
        "reuse_port": True,
        "models_control": control,
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


def health_ok(host: str, port: int, model: str | None = None, timeout: float = 1.0) -> bool:
    """Whether GET /health on host:port answers 200 (and, given a model, says it is loaded:
    a worker of it is in rotation; or that it cannot be). Sent as READY_PROBE_AGENT, whose
    503s are not logged."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/health", headers={"User-Agent": READY_PROBE_AGENT})
        response = connection.getresponse()
        if response.status != 200:
            return False
        if model is None:
            return True
        body = json.loads(response.read())
        # An unavailable one (its file cannot be loaded) will not come: serve what there is.
        return body.get("models", {}).get(model) in ("loaded", "unavailable")
    except (OSError, ValueError, AttributeError):
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
