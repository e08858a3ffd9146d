"""docs/options.md's option tables, generated from the click definitions.

`python -m loomserve.cli.docgen` rewrites the tables between the `<!-- options: NAME -->` and
`<!-- end options: NAME -->` markers; `--check` only says whether they are up to date (CI runs
it through tests/cli/test_settings.py). The prose around the tables is written by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from .main import main

OPTIONS_MD = Path(__file__).resolve().parent.parent / "docs" / "options.md"
MIB = 1024 * 1024
MARKER = re.compile(
    r"(<!-- options: (?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- end options: (?P=name) -->)",
    re.DOTALL,
)
# Options described in prose below the tables rather than in a row.
IN_PROSE = frozenset({"log_level", "log_json"})


def options_of(command_name: str) -> dict[str, click.Option]:
    """A command's options by parameter name, in the order --help lists them."""
    command = main.commands[command_name]
    return {p.name: p for p in command.params if isinstance(p, click.Option) and p.name}


def default_of(option: click.Option) -> object:
    """The value the option takes when not given.

    Click (8.2 and later) keeps an option declared without a default as its own sentinel,
    which would print as `Sentinel.UNSET`: a flag then means off, a repeatable option none.
    """
    if option.default is not getattr(click.core, "UNSET", None):
        return option.default
    if option.is_flag:
        return False
    return () if option.multiple else None


def rendered_default(default: object) -> str:
    """How the tables write a default: on/off, sizes in MiB, `none` where there is none."""
    if isinstance(default, bool):
        return "on" if default else "off"
    if default is None or default in ((), frozenset(), ""):
        return "none"
    if isinstance(default, tuple | list | frozenset):
        return " ".join(str(item) for item in default)
    if isinstance(default, int) and default >= MIB and default % MIB == 0:
        return f"{default // MIB} MiB"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def envvar_of(command_name: str, option: click.Option) -> str:
    """The option's environment variable, as click resolves it for this command."""
    if isinstance(option.envvar, str):
        return option.envvar
    prefix = "LOOMSERVE" if command_name != "bench" else "LOOMSERVE_BENCH"
    return f"{prefix}_{(option.name or '').upper()}"


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def row(command_name: str, option: click.Option, note: str = "") -> str:
    """One table row: flags (with the value's metavar), default, variable, help."""
    flags = "/".join(f"`{flag}`" for flag in (*option.opts, *option.secondary_opts))
    if note:
        flags += f" ({note})"
    help_text = cell(option.help or "")
    return (
        f"| {flags} | {cell(rendered_default(default_of(option)))} | "
        f"`{envvar_of(command_name, option)}` | {help_text} |"
    )


HEADER = "| Option | Default | Variable | What |\n|---|---|---|---|\n"


def table(name: str) -> str:
    """The rows of one marked table.

    `serve-only`: serve's options that neither `worker` nor `gateway` has. `worker` and
    `gateway`: that command's options, each not taken by `serve` marked "(alone only)".
    Any other name: every option of that command.
    """
    if name == "serve-only":
        shared = set(options_of("worker")) | set(options_of("gateway"))
        chosen = [("serve", o, "") for n, o in options_of("serve").items() if n not in shared]
    elif name in ("worker", "gateway"):
        serve = set(options_of("serve"))
        chosen = [
            (name, o, "" if n in serve else f"{name} alone only")
            for n, o in options_of(name).items()
        ]
    else:
        chosen = [(name, o, "") for o in options_of(name).values()]
    rows = [row(c, o, note) for c, o, note in chosen if o.name not in IN_PROSE]
    return HEADER + "\n".join(rows) + "\n"


def regenerate(text: str) -> str:
    """The document with every marked table written anew."""
    return MARKER.sub(lambda m: m.group(1) + table(m.group("name")) + m.group(4), text)


def run(argv: list[str]) -> int:
    """Rewrite docs/options.md, or with --check exit 1 if it is out of date."""
    current = OPTIONS_MD.read_text()
    fresh = regenerate(current)
    if "--check" in argv:
        if fresh != current:
            print("docs/options.md is out of date: python -m loomserve.cli.docgen")
            return 1
        return 0
    OPTIONS_MD.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
