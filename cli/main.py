"""`loomserve`: start the worker, the gateways, or both; and run the load generator.

Every option has an environment variable LOOMSERVE_<OPTION>, so compose files and the
command line share one set of names.
"""

from __future__ import annotations

from pathlib import Path

import click

from loomserve.cli.bench.command import bench
from loomserve.cli.default_model import resolve_model
from loomserve.gateway.config import GatewayConfig
from loomserve.worker.config import FLASH_ATTN_MODES, KV_CACHE_TYPES, WorkerConfig

CONTEXT_SETTINGS = {"auto_envvar_prefix": "LOOMSERVE", "show_default": True}


def worker_options(func):
    """The options that configure the worker; shared by `worker` and `serve`."""
    options = [
        click.option(
            "--model",
            type=click.Path(dir_okay=False),
            default=None,
            help="GGUF model file. Default: Gemma 3 270M from its PyPI package.",
        ),
        click.option(
            "--gpu-layers",
            type=int,
            default=-1,
            help="Layers to offload to the GPU; -1 for all (when built with a GPU backend).",
        ),
        click.option(
            "--threads", type=int, default=0, help="CPU threads for llama.cpp; 0 for all cores."
        ),
        click.option(
            "--flash-attn",
            type=click.Choice(FLASH_ATTN_MODES),
            default="auto",
            help="Flash attention; auto: where the backend has it, as llama-server does.",
        ),
        click.option(
            "--kv-cache-type",
            type=click.Choice(KV_CACHE_TYPES),
            default="f16",
            help="Data type of the KV cache.",
        ),
        click.option("--slots", type=int, default=8, help="Sequences decoded at once."),
        click.option(
            "--ctx-size",
            type=int,
            default=4096,
            help="Context tokens per slot, capped by the model's training context.",
        ),
        click.option(
            "--max-queue",
            type=int,
            default=64,
            help="Requests that may wait for a slot; beyond that they are rejected.",
        ),
        click.option(
            "--batch-tokens", type=int, default=512, help="Token budget of one tick's batch."
        ),
        click.option(
            "--prefill-chunk",
            type=int,
            default=512,
            help="Most prompt tokens one slot prefills per tick.",
        ),
        click.option(
            "--strategy",
            default="decode-maximal",
            help="Batching strategy: decode-maximal, prefill-priority, balanced, "
            "or a dotted path to your own class (package.module:Class).",
        ),
        click.option(
            "--metrics-port",
            type=int,
            default=None,
            help="Serve the worker's Prometheus metrics on this port.",
        ),
        click.option(
            "--metrics-host",
            default="127.0.0.1",
            help="Address of the metrics endpoint (0.0.0.0 for Prometheus in another container).",
        ),
        click.option(
            "--gateway-timeout",
            type=click.FloatRange(min=0.1),
            default=5.0,
            help="Seconds a gateway may be silent before its requests are cancelled.",
        ),
        click.option(
            "--batch-invariant/--no-batch-invariant",
            default=True,
            help="Greedy output the same alone and batched: a KV stream per slot and per-row "
            "CPU kernels. Off: one KV cache shared by all slots and the fastest kernels.",
        ),
        click.option(
            "--log-ticks/--no-log-ticks", default=False, help="Log one structured event per tick."
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def gateway_options(func):
    """The options that configure a gateway; shared by `gateway` and `serve`."""
    options = [
        click.option("--host", default="127.0.0.1", help="HTTP address to listen on."),
        click.option("--port", type=int, default=8000, help="HTTP port to listen on."),
        click.option(
            "--served-model-name",
            default=None,
            help="Model name in the API. Default: the model file's name.",
        ),
        click.option(
            "--api-key",
            multiple=True,
            help="Accepted API key (repeatable). Without any, no key is needed.",
        ),
        click.option(
            "--api-key-file",
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            help="File of accepted API keys, one per line.",
        ),
        click.option(
            "--chat-template",
            default=None,
            help="Jinja chat template (text or a file path) overriding the model's own.",
        ),
        click.option(
            "--max-body-bytes",
            type=click.IntRange(min=1),
            default=8 * 1024 * 1024,
            help="Largest request body accepted; a larger one gets 413.",
        ),
        click.option(
            "--heartbeat-interval",
            type=click.FloatRange(min=0.01),
            default=1.0,
            help="Seconds between the gateway's pings to the worker.",
        ),
        click.option(
            "--worker-timeout",
            type=click.FloatRange(min=0.05),
            default=3.0,
            help="Seconds without a word from the worker before it counts as down (503).",
        ),
        click.option(
            "--request-timeout",
            type=click.FloatRange(min=0.1),
            default=600.0,
            help="Longest a generation may run before it is cut off with a 504.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def log_options(func):
    func = click.option(
        "--log-json/--no-log-json",
        default=None,
        help="JSON log lines. Default: on when stderr is not a terminal.",
    )(func)
    return click.option("--log-level", default="info", help="Log level.")(func)


def build_worker_config(bind: str, **opts) -> WorkerConfig:
    return WorkerConfig(
        model_path=resolve_model(opts["model"]),
        bind=bind,
        gpu_layers=opts["gpu_layers"],
        threads=opts["threads"],
        flash_attn=opts["flash_attn"],
        kv_cache_type=opts["kv_cache_type"],
        slots=opts["slots"],
        ctx_size=opts["ctx_size"],
        max_queue=opts["max_queue"],
        batch_tokens=opts["batch_tokens"],
        prefill_chunk=opts["prefill_chunk"],
        strategy=opts["strategy"],
        metrics_port=opts["metrics_port"],
        metrics_host=opts["metrics_host"],
        gateway_timeout=opts["gateway_timeout"],
        batch_invariant=opts["batch_invariant"],
        log_ticks=opts["log_ticks"],
    )


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except OSError:  # template text too long to be a file name
        return False


def build_gateway_config(worker: str, **opts) -> GatewayConfig:
    keys = set(opts["api_key"])
    if opts["api_key_file"]:
        lines = Path(opts["api_key_file"]).read_text().splitlines()
        keys.update(line.strip() for line in lines if line.strip() and not line.startswith("#"))
    template = opts["chat_template"]
    if template and _is_file(template):
        template = Path(template).read_text()
    return GatewayConfig(
        model_path=resolve_model(opts["model"]),
        worker=worker,
        host=opts["host"],
        port=opts["port"],
        model_name=opts["served_model_name"],
        api_keys=frozenset(keys),
        chat_template=template,
        max_body_bytes=opts["max_body_bytes"],
        heartbeat_interval=opts["heartbeat_interval"],
        worker_timeout=opts["worker_timeout"],
        request_timeout=opts["request_timeout"],
    )


@click.group(context_settings=CONTEXT_SETTINGS)
def main() -> None:
    """loomserve: continuous-batching LLM serving on llama.cpp."""


@main.command(context_settings=CONTEXT_SETTINGS)
@worker_options
@click.option("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ endpoint gateways connect to.")
@log_options
def worker(bind: str, log_level: str, log_json: bool | None, **opts) -> None:
    """Run the model-owning worker alone."""
    from loomserve.cli.logs import configure_logging
    from loomserve.worker.server import run_worker

    configure_logging(level=log_level, json=log_json)
    run_worker(build_worker_config(bind, **opts))


@main.command(context_settings=CONTEXT_SETTINGS)
@gateway_options
@click.option(
    "--model",
    type=click.Path(dir_okay=False),
    default=None,
    help="The worker's GGUF model; the gateway loads its vocabulary only.",
)
@click.option(
    "--worker",
    "worker_endpoint",
    default="tcp://127.0.0.1:5555",
    help="ZeroMQ endpoint of the worker.",
)
@click.option(
    "--reuse-port/--no-reuse-port",
    default=False,
    help="Bind with SO_REUSEPORT, so several gateways share the port (the kernel balances).",
)
@log_options
def gateway(
    worker_endpoint: str, reuse_port: bool, log_level: str, log_json: bool | None, **opts
) -> None:
    """Run one HTTP gateway alone."""
    from loomserve.cli.logs import configure_logging
    from loomserve.cli.supervisor import reuse_port_socket
    from loomserve.gateway.server import run_gateway

    configure_logging(level=log_level, json=log_json)
    config = build_gateway_config(worker_endpoint, **opts)
    sockets = [reuse_port_socket(config.host, config.port)] if reuse_port else None
    run_gateway(config, sockets=sockets)


@main.command(context_settings=CONTEXT_SETTINGS)
@worker_options
@gateway_options
@click.option(
    "--gateways",
    type=click.IntRange(min=1),
    default=1,
    help="Gateway processes sharing the HTTP port.",
)
@log_options
def serve(gateways: int, log_level: str, log_json: bool | None, **opts) -> None:
    """Run everything on this machine: one worker and --gateways gateways, supervised."""
    from loomserve.cli import serve as serving
    from loomserve.cli.logs import configure_logging
    from loomserve.cli.supervisor import check_port_free

    configure_logging(level=log_level, json=log_json)
    try:
        model = resolve_model(opts["model"])
        options = {**opts, "model": str(model), "log_level": log_level, "log_json": log_json}
        build_worker_config("ipc://check", **options)  # bad settings fail here, not in a child
        build_gateway_config("ipc://check", **options)
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        check_port_free(opts["host"], opts["port"])
    except OSError as exc:
        raise click.ClickException(
            f"cannot listen on {opts['host']}:{opts['port']}: {exc}"
        ) from exc
    plan = serving.ServePlan(
        model=model, host=opts["host"], port=opts["port"], gateways=gateways, options=options
    )
    raise SystemExit(serving.serve(plan, worker_command=worker, gateway_command=gateway))


@main.command("worker-health", context_settings=CONTEXT_SETTINGS)
@click.option(
    "--worker",
    "worker_endpoint",
    default="tcp://127.0.0.1:5555",
    help="ZeroMQ endpoint of the worker to probe.",
)
@click.option("--timeout", type=float, default=3.0, help="Seconds to wait for the answer.")
def worker_health(worker_endpoint: str, timeout: float) -> None:
    """Exit 0 when the worker answers a Ping and its model is loaded; for health checks."""
    from loomserve.cli.health import probe_worker

    beat = probe_worker(worker_endpoint, timeout)
    if beat is None:
        raise click.ClickException(f"no answer from {worker_endpoint} within {timeout} s")
    if not beat.ready:
        raise click.ClickException(f"{worker_endpoint} answers but is not ready yet")
    click.echo(
        f"ready: {beat.running} running, {beat.free_slots} slots free, {beat.queue_depth} queued"
    )


main.add_command(bench)


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
