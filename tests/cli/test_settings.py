"""Settings are declared once, on the config dataclasses; the command line and docs follow.

The click options take their defaults from WorkerConfig and GatewayConfig (cli.options.default_of),
every field can be set from the command line, and docs/options.md's tables, generated from the
click options (`python -m loomserve.cli.docgen`), are up to date and list every option with the
same default. A new setting that misses one of these fails here.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import click
import pytest

from loomserve.cli import docgen
from loomserve.cli.main import main
from loomserve.cli.options import default_of
from loomserve.gateway.config import GatewayConfig
from loomserve.worker.config import WorkerConfig

OPTIONS_MD = Path(__file__).resolve().parents[2] / "docs" / "options.md"

# Fields set from something other than an option of the same name.
WORKER_DERIVED = {"model_path": "model"}
GATEWAY_DERIVED = {
    "model_path": "model",
    "models": "model",  # NAME=PATH values of --model
    "worker_endpoints": "worker_endpoint",
    "model_name": "served_model_name",
    "api_keys": "api_key",
    "key_priorities": "api_key_file",  # `priority=` on a key file's lines
    "admin_keys": "api_key_file",  # `role=admin` on a key file's lines
    "chat_template_from": "chat_template",  # where --chat-template's template came from
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
        # serve names its own model manager; its --model takes several models itself.
        ("gateway", {"model", "reuse_port", "models_control", *curve_gateway}),
    ):
        missing = set(options_of(command_name)) - set(serve) - only_alone - {"worker_endpoint"}
        assert not missing, f"serve lacks {command_name} options {missing}"


def test_the_option_tables_are_generated_from_the_click_options() -> None:
    current = OPTIONS_MD.read_text()
    assert docgen.regenerate(current) == current, "run: python -m loomserve.cli.docgen"


# What a default must never print as: click's sentinel for "no default", or a Python repr.
REPR = re.compile(r"Sentinel|UNSET|object at|^<|^[([{'\"]|Path\(|^$")


@pytest.mark.parametrize("command_name", sorted(main.commands))
def test_no_default_prints_as_a_sentinel_or_a_python_repr(command_name: str) -> None:
    for option in options_of(command_name).values():
        shown = docgen.rendered_default(docgen.default_of(option))
        assert not REPR.search(shown), f"{command_name} {option.opts[0]}: default {shown!r}"


def documented_option_rows() -> dict[str, str]:
    """`--flag` → the Default cell of its row, from docs/options.md's tables of the servers."""
    text = OPTIONS_MD.read_text()
    section = text[: text.index("## `loomserve bench`")]
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
    """How the tables write a default; None where it uses words ("none", "the model's")."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if (
        default is None
        or default == ""
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
def test_the_docs_list_every_option_with_its_default(command_name: str) -> None:
    rows = documented_option_rows()
    for option in options_of(command_name).values():
        if option.name in ("log_level", "log_json"):  # described in prose below the tables
            continue
        flag = next(o for o in option.opts if o.startswith("--"))
        assert flag in rows, f"docs/options.md lacks {flag}"
        expected = rendered(option.default)
        if expected is not None:
            assert rows[flag] == expected, f"docs/options.md gives {flag} default {rows[flag]!r}"
