"""The operator's small commands: `loomserve worker-health` (a container's health check) and
`loomserve keygen` (CURVE certificates). Their modules load only when they run: the
worker's own command must import llama.cpp before pyzmq (docs/gpu.md)."""

from __future__ import annotations

from pathlib import Path

import click

from loomserve.cli.options import CONTEXT_SETTINGS, curve_client_options


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
    default="tcp://127.0.0.1:5555",
    help="ZeroMQ endpoint of the worker to probe.",
)
@click.option("--timeout", type=float, default=3.0, help="Seconds to wait for the answer.")
@curve_client_options
def worker_health(
    worker_endpoint: str,
    timeout: float,
    curve_server_key_file: Path | None,
    curve_secret_key_file: Path | None,
) -> None:
    """Exit 0 when the worker answers a Ping and its model is loaded; for health checks."""
    from loomserve.cli.health import probe

    if (curve_server_key_file is None) != (curve_secret_key_file is None):
        raise click.UsageError("--curve-server-key-file and --curve-secret-key-file go together")
    curve = None
    if curve_server_key_file is not None and curve_secret_key_file is not None:
        curve = (curve_server_key_file, curve_secret_key_file)
    try:
        found = probe(worker_endpoint, timeout, curve)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    beat = found.beat
    if beat is None:
        why = f": {found.handshake_failure}" if found.handshake_failure else ""
        raise click.ClickException(f"no answer from {worker_endpoint} within {timeout} s{why}")
    if not beat.ready:
        raise click.ClickException(f"{worker_endpoint} answers but is not ready yet")
    load = beat.load
    click.echo(
        f"ready: {load.running} running, {load.free_slots} slots free, {load.queue_depth} queued"
    )


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
    from loomserve.cli.keygen import ensure_certificates, ensure_split_certificates

    made_now = ensure_split_certificates if split else ensure_certificates
    for secret, made in made_now(directory, list(names)):
        click.echo(f"{'made' if made else 'kept'} {secret} and {secret.with_suffix('.key')}")
