"""`loomserve serve`: one worker and N gateways on one machine, sharing one HTTP port.

The worker listens on an ipc:// socket in a private temp dir; each gateway binds the HTTP port
itself with SO_REUSEPORT, so the kernel spreads connections across them. The gateways share a
Prometheus multiprocess dir in the same temp dir, so any gateway's /metrics counts them all.
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


def serve(plan: ServePlan, worker_command: click.Command, gateway_command: click.Command) -> int:
    """Run the plan under a supervisor until SIGINT/SIGTERM; the exit status."""
    workdir = Path(tempfile.mkdtemp(prefix="loomserve-"))
    try:
        endpoint = f"ipc://{workdir / 'worker.ipc'}"
        metrics_dir = workdir / "prometheus"
        metrics_dir.mkdir()
        children = child_specs(plan, endpoint, metrics_dir, worker_command, gateway_command)
        url = f"http://{_url_host(plan.host)}:{plan.port}"
        log.info(
            "starting", url=url, gateways=plan.gateways, worker=endpoint, model=str(plan.model)
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
        )
        return supervisor.run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def child_specs(
    plan: ServePlan,
    endpoint: str,
    metrics_dir: Path,
    worker_command: click.Command,
    gateway_command: click.Command,
) -> list[ChildSpec]:
    """The worker, then the gateways; on the way down, the gateways stop first."""
    worker_values = {**plan.options, "model": str(plan.model), "bind": endpoint}
    worker = ChildSpec(
        name="worker",
        argv=child_argv(worker_command, worker_values),
        env=child_env(plan.options, drop=("PROMETHEUS_MULTIPROC_DIR",)),
    )
    gateway_values = {
        **plan.options,
        "model": str(plan.model),
        "worker_endpoint": endpoint,
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
    return [worker, *gateways]


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
        env[f"LOOMSERVE_{name.upper()}"] = " ".join(values[name] or ())
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
