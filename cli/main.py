"""`loomserve`: start the worker, the gateways, or both; and run the load generator.

Every option has an environment variable LOOMSERVE_<OPTION>, so compose files and the
command line share one set of names.
"""

from __future__ import annotations

# isort: off
# llama.cpp's shared libraries are the first extension modules every loomserve process loads.
# On an H200 with llama.cpp built for CUDA (2026-11-26) the worker died with SIGSEGV in
# llama_model_load_from_file when numpy, msgpack and others had loaded before libllama (pyzmq
# after it, as worker/server.py orders them); a process whose first import was llama_cpp
# loaded the model and served. tests/e2e/test_import_order.py keeps this order.
import llama_cpp  # noqa: F401

# isort: on
import dataclasses

import click

from ..gateway.config import (
    GatewayConfig,
)
from ..worker.config import (
    WorkerConfig,
)
from .default_model import (
    MODELS_MAX,
    UNLOAD_DRAIN_SECONDS,
    named_models,
    pair_projectors,
)
from .operations import keygen, worker_health, workers
from .options import (
    CONTEXT_SETTINGS,
    build_gateway_config,
    build_worker_config,
    curve_client_options,
    default_of,
    gateway_options,
    log_options,
    options_from,
    tracing_options,
    worker_options,
)


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="loomserve", prog_name="loomserve")
def main() -> None:
    """loomserve: continuous-batching LLM serving on llama.cpp."""


@main.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "--model",
    type=click.Path(dir_okay=False),
    default=None,
    help="GGUF model file. Default: Gemma 3 270M from its PyPI package.",
)
@worker_options
@options_from(WorkerConfig, alone=True)
@tracing_options
@log_options
def worker(bind: str, log_level: str, log_json: bool | None, **opts) -> None:
    """Run the model-owning worker alone."""
    from ..worker.server import run_worker
    from .logs import configure_logging
    from .tracing import WORKER_SERVICE, traced, traces_url

    configure_logging(level=log_level, json=log_json)
    opts["otlp_endpoint"] = traces_url(opts["otlp_endpoint"])
    config = build_worker_config(bind, **opts)
    with traced(WORKER_SERVICE, config.otlp_endpoint):
        run_worker(config)


@main.command(context_settings=CONTEXT_SETTINGS)
@gateway_options
@curve_client_options
@click.option(
    "--model",
    multiple=True,
    help="A model's GGUF file, whose vocabulary the gateway loads (never its weights). One "
    "PATH: every worker serves that model (with the same vocabulary), under "
    "--served-model-name. NAME=PATH (repeatable): a worker named NAME (its "
    "--served-model-name) serves it. Without any, the gateway learns each worker's model, "
    "vocabulary and chat template from the worker: add a model by adding its workers.",
)
@click.option(
    "--models-control",
    default=default_of(GatewayConfig, "models_control"),
    help="ZeroMQ endpoint of `serve`'s model manager, which loads models on demand "
    "(`serve` sets it).",
)
@click.option(
    "--worker",
    "worker_endpoint",
    multiple=True,
    default=default_of(GatewayConfig, "worker_endpoints"),
    help="ZeroMQ endpoint of a worker (repeatable; space-separated in the variable). "
    "tcp://NAME:PORT means every address NAME resolves to, looked up again every few seconds.",
)
@click.option(
    "--reuse-port/--no-reuse-port",
    default=False,
    help="Bind with SO_REUSEPORT, so several gateways share the port (the kernel balances).",
)
@tracing_options
@log_options
def gateway(
    worker_endpoint: tuple[str, ...],
    reuse_port: bool,
    log_level: str,
    log_json: bool | None,
    **opts,
) -> None:
    """Run one HTTP gateway alone."""
    from ..gateway.http.server import run_gateway
    from .logs import configure_logging
    from .supervisor import reuse_port_socket
    from .tracing import GATEWAY_SERVICE, traced

    configure_logging(level=log_level, json=log_json)
    try:
        config = build_gateway_config(worker_endpoint, **opts)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    sockets = [reuse_port_socket(config.host, config.port)] if reuse_port else None
    with traced(GATEWAY_SERVICE, config.otlp_endpoint):
        run_gateway(config, sockets=sockets)


@main.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "--model",
    multiple=True,
    help="GGUF model file: PATH, or NAME=PATH to serve it as NAME (repeatable: several "
    "models behind one endpoint, picked by each request's `model`). Default: Gemma 3 270M "
    "from its PyPI package.",
)
@click.option(
    "--models-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Serve every *.gguf in this folder, each named by its file name without .gguf.",
)
@click.option(
    "--models-max",
    type=click.IntRange(min=1),
    default=MODELS_MAX,
    help="With several models: most loaded at once. A request for another loads it, "
    "first unloading the least recently used idle one.",
)
@click.option(
    "--idle-unload",
    type=click.FloatRange(min=1.0),
    default=None,
    help="With several models: unload a model idle this many seconds (its memory is freed; "
    "the next request for it loads it again). Default: never.",
)
@click.option(
    "--unload-drain",
    type=click.FloatRange(min=0.0),
    default=UNLOAD_DRAIN_SECONDS,
    help="With several models: how long, in seconds, an unloading model's running requests "
    "may take to finish before its workers are stopped (new requests for it get 503 with "
    "Retry-After meanwhile).",
)
@click.option(
    "--mmproj",
    multiple=True,
    envvar="LOOMSERVE_MMPROJ",
    help="Vision projector (mmproj GGUF) of a model, whose requests may then carry images: "
    "PATH for the one model, NAME=PATH for the model served as NAME (repeatable). With "
    "--models-dir, mmproj-<model file name> beside a model is its projector.",
)
@worker_options
@gateway_options
@click.option(
    "--gateways",
    type=click.IntRange(min=1),
    default=1,
    help="Gateway processes sharing the HTTP port.",
)
@click.option(
    "--max-restart-delay",
    type=click.FloatRange(min=0.0),
    default=30.0,
    help="Longest wait, in seconds, before restarting a child that keeps crashing.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes (replicas of the model) behind the gateways. "
    "Default: one per --gpus entry, else 1.",
)
@click.option(
    "--gpus",
    default=None,
    help="GPUs to run workers on, comma-separated (0,1): one worker per GPU, each seeing "
    "only its own (CUDA_VISIBLE_DEVICES).",
)
@tracing_options
@log_options
def serve(
    gateways: int,
    max_restart_delay: float,
    workers: int | None,
    gpus: str | None,
    models_dir: str | None,
    models_max: int,
    idle_unload: float | None,
    unload_drain: float,
    mmproj: tuple[str, ...],
    log_level: str,
    log_json: bool | None,
    **opts,
) -> None:
    """Run everything on this machine: --workers workers and --gateways gateways, supervised;
    with several models, each model's workers, loaded on demand."""
    from . import serve as serving
    from .logs import configure_logging
    from .supervisor import check_port_free

    configure_logging(level=log_level, json=log_json)
    try:
        devices = serving.parse_gpus(gpus)
        replicas = serving.worker_count(workers, devices)
        models = named_models(opts["model"], models_dir) or named_models([""])
        if len(models) == 1 and not models[0].named and opts["served_model_name"]:
            # One model: the manager knows it by the name the gateways serve it under.
            name = opts["served_model_name"].split(",")[0].strip()  # NAME,ALIAS,...
            models = [dataclasses.replace(models[0], name=name)]
        models = pair_projectors(models, mmproj)
        threads = serving.threads_per_worker(opts["threads"], replicas)
        options = {**opts, "threads": threads, "log_level": log_level, "log_json": log_json}
        # Bad settings fail here, not in a child.
        build_worker_config("ipc://check", **{**options, "model": str(models[0].path)})
        build_gateway_config("ipc://check", **{**options, "model": serving.gateway_models(models)})
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        check_port_free(opts["host"], opts["port"])
    except OSError as exc:
        raise click.ClickException(
            f"cannot listen on {opts['host']}:{opts['port']}: {exc}"
        ) from exc
    plan = serving.ServePlan(
        models=tuple(models),
        models_max=models_max,
        idle_unload=idle_unload,
        unload_drain=unload_drain,
        host=opts["host"],
        port=opts["port"],
        gateways=gateways,
        options=options,
        max_restart_delay=max_restart_delay,
        workers=replicas,
        gpus=devices,
    )
    raise SystemExit(serving.serve(plan, worker_command=worker, gateway_command=gateway))


def _bench_command() -> click.Command:
    """`loomserve bench`, or a command that says how to install it: it is an extra."""
    try:
        from .bench.command import bench
    except ImportError as exc:
        missing = exc.name

        @click.command("bench", context_settings={"ignore_unknown_options": True})
        @click.argument("args", nargs=-1, type=click.UNPROCESSED)
        def bench(args: tuple[str, ...]) -> None:
            """The load generator (needs `pip install 'loomserve[bench]'`)."""
            raise click.ClickException(
                f"loomserve bench needs {missing}: pip install 'loomserve[bench]'"
            )

    return bench


main.add_command(worker_health)
main.add_command(workers)
main.add_command(keygen)
main.add_command(_bench_command())


def _show_envvars(group: click.Group) -> None:
    """List each option's environment variable in --help: LOOMSERVE_WORKER_ENDPOINT for
    --worker, for one, is not a name to guess."""
    for command in group.commands.values():
        for param in command.params:
            if isinstance(param, click.Option):
                param.show_envvar = True


_show_envvars(main)

if __name__ == "__main__":
    main()
