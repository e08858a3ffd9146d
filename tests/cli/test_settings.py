"""Settings are declared once, on the config dataclasses; the command line and README follow.

The click options take their defaults from WorkerConfig and GatewayConfig (cli.main.default_of),
every field can be set from the command line, and the README's option tables list every
option with the same default. A new setting that misses one of the three fails here.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import click
import pytest

from loomserve.cli.main import default_of, main
from loomserve.gateway.config import GatewayConfig
from loomserve.worker.config import WorkerConfig

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()

# Fields set from something other than an option of the same name.
WORKER_DERIVED = {"model_path": "model"}
GATEWAY_DERIVED = {
    "model_path": "model",
    "workers": "worker_endpoint",
    "model_name": "served_model_name",
    "api_keys": "api_key",
}
MIB = 1024 * 1024


def options_of(command_name: str) -> dict[str, click.Option]:
    command = main.commands[command_name]
    return {p.name: p for p in command.params if isinstance(p, click.Option) and p.name}


@pytest.mark.parametrize(
    ("config", "command_name", "derived"),
    [(WorkerConfig, "worker", WORKER_DERIVED), (GatewayConfig, "gateway", GATEWAY_DERIVED)],
)
def test_every_setting_has_an_option_with_the_configs_default(
    config: type, command_name: str, derived: dict[str, str]
) -> None:
    options = options_of(command_name)
    for setting in fields(config):
        name = derived.get(setting.name, setting.name)
        assert name in options, f"{config.__name__}.{setting.name} has no --option"
        if setting.name not in derived:
            assert options[name].default == default_of(config, setting.name), setting.name


def test_serve_takes_every_worker_and_gateway_option() -> None:
    serve = options_of("serve")
    # serve's worker binds a private ipc path its gateways share: nothing to authenticate.
    curve_worker = {"curve_secret_key_file", "curve_allowed_keys", "insecure_bind"}
    curve_gateway = {"curve_server_key_file", "curve_secret_key_file"}
    for command_name, only_alone in (
        ("worker", {"bind", *curve_worker}),
        ("gateway", {"model", "reuse_port", *curve_gateway}),
    ):
        missing = set(options_of(command_name)) - set(serve) - only_alone - {"worker_endpoint"}
        assert not missing, f"serve lacks {command_name} options {missing}"


def readme_option_rows() -> dict[str, str]:
    """`--flag` → the Default cell of its row, from the README's Command line tables."""
    section = README[README.index("## Command line") : README.index("## Batching strategies")]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`--"):
            continue
        flags = re.findall(r"`(--[a-z0-9-]+)", cells[0])
        defaults = [d.strip() for d in cells[1].split(",")]
        if len(defaults) != len(flags):  # one default for the whole row
            defaults = [cells[1]] * len(flags)
        rows.update(zip(flags, defaults, strict=True))
    return rows


def rendered(default: object) -> str | None:
    """How the README writes a default; None where it uses words ("none", "the model's")."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if (
        default is None
        or isinstance(default, frozenset | tuple)
        or not isinstance(default, str | int | float)
    ):  # unset, or a repeatable option
        return None
    if isinstance(default, int) and default >= MIB and default % MIB == 0:
        return f"{default // MIB} MiB"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


@pytest.mark.parametrize("command_name", ["worker", "gateway", "serve"])
def test_the_readme_lists_every_option_with_its_default(command_name: str) -> None:
    rows = readme_option_rows()
    for option in options_of(command_name).values():
        if option.name in ("log_level", "log_json"):  # described in prose below the tables
            continue
        flag = next(o for o in option.opts if o.startswith("--"))
        assert flag in rows, f"README's option tables lack {flag}"
        expected = rendered(option.default)
        if expected is not None:
            assert rows[flag] == expected, f"README gives {flag} default {rows[flag]!r}"
