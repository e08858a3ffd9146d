"""The operator's small commands: `loomserve worker-health` (a container's health check),
`loomserve workers` (a running serve's worker endpoints) and `loomserve keygen` (CURVE
certificates). Their modules load only when they run: the worker's own command must import
llama.cpp before pyzmq (docs/gpu.md)."""

from __future__ import annotations

import json
from pathlib import Path

import click
from click.core import ParameterSource

from .options import CONTEXT_SETTINGS, curve_client_options

# The compose file's worker endpoint; serve's own workers are found without it.
DEFAULT_WORKER = "tcp://127.0.0.1:5555"


class _WorkerHealthCommand(click.Command):
    """worker-health, pointing the names operators guess for --worker at it: click suggests
    only names spelled alike, and --endpoint is not."""

    GUESSES = ("--endpoint", "--worker-endpoint", "--bind", "--address")

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            if exc.option_name not in self.GUESSES:
                raise
            # click keeps only possibilities spelled like the name: say it in the message.
            message = (
                f"No such option {exc.option_name!r}. Did you mean '--worker' "
                "(the worker's ZeroMQ endpoint)?"
            )
            raise click.NoSuchOption(exc.option_name, message, ctx=ctx) from None


@click.command("worker-health", cls=_WorkerHealthCommand, context_settings=CONTEXT_SETTINGS)
@click.option(
    "--worker",
    "worker_endpoint",
    default=DEFAULT_WORKER,
    help="ZeroMQ endpoint of the worker to probe. Not given: the workers of each running "
    "`loomserve serve` (`loomserve workers` lists them), else this default.",
)
@click.option("--timeout", type=float, default=3.0, help="Seconds to wait for the answer.")
@curve_client_options
@click.pass_context
def worker_health(
    ctx: click.Context,
    worker_endpoint: str,
    timeout: float,
    curve_server_key_file: Path | None,
    curve_secret_key_file: Path | None,
) -> None:
    """Exit 0 when the worker answers a Ping and its model is loaded; for health checks."""
    from .serve_registry import running

    if (curve_server_key_file is None) != (curve_secret_key_file is None):
        raise click.UsageError("--curve-server-key-file and --curve-secret-key-file go together")
    curve = None
    if curve_server_key_file is not None and curve_secret_key_file is not None:
        curve = (curve_server_key_file, curve_secret_key_file)
    given = ctx.get_parameter_source("worker_endpoint") != ParameterSource.DEFAULT
    serves = [] if given else running()
    if not serves:
        ok, said = _health(worker_endpoint, timeout, curve)
        if not ok:
            raise click.ClickException(said)
        click.echo(said)
        return
    # serve's workers: each one's state on its own line; a model loaded on demand that is
    # not loaded now has no worker running, which is no fault.
    failed = ready = 0
    for serve in serves:
        for endpoint in serve.endpoints():
            ok, said = _health(endpoint, timeout, curve)
            if not ok and serve.on_demand and said.startswith("no answer"):
                said = f"{endpoint}: not running (its model is not loaded now)"
            else:
                failed += not ok
                ready += ok
            click.echo(said if said.startswith(endpoint) else f"{endpoint}: {said}")
    if failed or not ready:
        raise click.ClickException(f"{failed} of serve's workers not ready")


def _health(endpoint: str, timeout: float, curve: tuple[Path, Path] | None) -> tuple[bool, str]:
    """Whether the worker at endpoint is ready, and what to say about it."""
    from .health import probe

    try:
        found = probe(endpoint, timeout, curve)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    beat = found.beat
    if beat is None:
        why = f": {found.handshake_failure}" if found.handshake_failure else ""
        return False, f"no answer from {endpoint} within {timeout} s{why}"
    if not beat.ready:
        return False, f"{endpoint} answers but is not ready yet"
    load = beat.load
    return (
        True,
        f"ready: {load.running} running, {load.free_slots} slots free, {load.queue_depth} queued",
    )


@click.command("workers", context_settings=CONTEXT_SETTINGS)
@click.option("--json", "as_json", is_flag=True, default=False, help="One JSON object a serve.")
def workers(as_json: bool) -> None:
    """List the workers of each running `loomserve serve`: their ipc:// endpoints by model."""
    from .serve_registry import running, runtime_dir

    serves = running()
    if not serves:
        raise click.ClickException(
            f"no loomserve serve is running (none listed in {runtime_dir()})"
        )
    for serve in serves:
        if as_json:
            body = {"pid": serve.pid, "url": serve.url, "models": dict(serve.models)}
            click.echo(json.dumps({**body, "on_demand": serve.on_demand}))
            continue
        click.echo(f"serve (pid {serve.pid}) at {serve.url}")
        for model, endpoints in serve.models.items():
            loaded = " (loaded on demand)" if serve.on_demand else ""
            for endpoint in endpoints:
                click.echo(f"  {model}: {endpoint}{loaded}")


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path), default=Path("keys"))
@click.option(
    "--name",
    "names",
    multiple=True,
    default=("worker", "gateway"),
    help="A certificate to make (repeatable): NAME.key and NAME.key_secret.",
)
@click.option(
    "--split",
    is_flag=True,
    default=False,
    help="Each NAME's certificate in DIRECTORY/NAME/, with the other names' public keys: "
    "mount one folder per service and none reads another's secret key.",
)
def keygen(directory: Path, names: tuple[str, ...], split: bool) -> None:
    """Make CURVE certificates for the worker and its gateways in DIRECTORY (default: keys);
    existing ones are kept."""
    from .keygen import ensure_certificates, ensure_split_certificates

    made_now = ensure_split_certificates if split else ensure_certificates
    for secret, made in made_now(directory, list(names)):
        click.echo(f"{'made' if made else 'kept'} {secret} and {secret.with_suffix('.key')}")
