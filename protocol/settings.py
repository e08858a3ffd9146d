"""How a setting is declared, once, on the worker's and the gateway's config dataclasses.

A field made with `setting(...)` carries what the command line shows of it: its help, the
range or choices it accepts, its flag when that is not the field's name. cli/options.py
makes the click options from these (and docs/options.md is generated from those), so a
setting's name, type, default, help and bounds live in one place. Plain data only: the
configs import no command-line library.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, field
from typing import Any

SETTING = "loomserve.setting"  # the key of a field's metadata that holds its SettingInfo


class SettingInfo:
    """What the command line says of one setting."""

    __slots__ = (
        "aliases",
        "alone",
        "choices",
        "flag",
        "help",
        "high",
        "low",
        "low_open",
        "negatable",
        "path",
    )

    def __init__(
        self,
        help: str,
        low: float | None,
        high: float | None,
        low_open: bool,
        choices: Sequence[str] | None,
        flag: str | None,
        negatable: bool,
        alone: bool,
        path: str | None,
        aliases: Sequence[str] = (),
    ) -> None:
        self.help = help
        self.low = low  # the least value accepted (excluded when low_open)
        self.high = high
        self.low_open = low_open
        self.choices = tuple(choices) if choices is not None else None
        self.flag = flag  # e.g. "--served-model-name" for model_name; None: from the name
        self.negatable = negatable  # a bool as --x/--no-x (else a bare --x flag)
        # Only for the process run alone (`loomserve worker`), not under `serve`, which
        # sets it itself (the worker's endpoint) or shares the gateway's option of the name.
        self.alone = alone
        self.path = path  # "file": an existing file; "any": an existing file or folder
        self.aliases = tuple(aliases)  # other flags taking it (an older name, another server's)


def setting(
    default: Any = MISSING,
    *,
    help: str,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    choices: Sequence[str] | None = None,
    flag: str | None = None,
    negatable: bool = True,
    alone: bool = False,
    path: str | None = None,
    aliases: Sequence[str] = (),
    default_factory: Callable[[], Any] | Any = MISSING,
) -> Any:
    """A dataclass field with its command-line description."""
    info = SettingInfo(help, low, high, low_open, choices, flag, negatable, alone, path, aliases)
    made: Field[Any] = field(
        default=default, default_factory=default_factory, metadata={SETTING: info}
    )
    return made


def setting_info(declared: Field[Any]) -> SettingInfo | None:
    """The SettingInfo of a dataclass field, None for a field that is no setting."""
    info = declared.metadata.get(SETTING)
    return info if isinstance(info, SettingInfo) else None
