"""Click options made from the config dataclasses' settings (protocol/settings.py).

Each field declared with `setting(...)` becomes one option: its flag from the field's name
(or the setting's `flag`), its default the field's, its type from the annotation and the
setting's range or choices, its help the setting's. A config built from the options takes
every such field from the option of the same name (`settings_from`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

import click

from loomserve.protocol.settings import SettingInfo, setting_info

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def settings_of(config: type) -> list[tuple[Field[Any], SettingInfo]]:
    """The fields of a config dataclass that are settings, in declaration order."""
    found = []
    for declared in fields(config):
        info = setting_info(declared)
        if info is not None:
            found.append((declared, info))
    return found


def option_name(declared: Field[Any], info: SettingInfo) -> str:
    """The name click gives the option's value: the flag's, without dashes."""
    flag = info.flag or "--" + declared.name.replace("_", "-")
    return flag.removeprefix("--").replace("-", "_")


def options_from(config: type) -> Decorator:
    """A decorator adding an option for each of the config's settings."""
    made = [_option(declared, info) for declared, info in settings_of(config)]

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(made):
            func = option(func)
        return func

    return decorate


def settings_from(config: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The config's settings from a command's option values, by field name."""
    return {
        declared.name: values[option_name(declared, info)]
        for declared, info in settings_of(config)
        if option_name(declared, info) in values
    }


def _option(declared: Field[Any], info: SettingInfo) -> Decorator:
    flag = info.flag or "--" + declared.name.replace("_", "-")
    annotation = str(declared.type).replace(" ", "")
    default = _default(declared)
    kwargs: dict[str, Any] = {"default": default, "help": info.help}
    if annotation in ("bool", "bool|None"):  # None: decided from other settings
        if info.negatable:
            negative = "--no-" + flag.removeprefix("--")
            return click.option(f"{flag}/{negative}", option_name(declared, info), **kwargs)
        return click.option(flag, option_name(declared, info), is_flag=True, **kwargs)
    if annotation.startswith("tuple["):
        kwargs["multiple"] = True
    elif info.choices is not None:
        kwargs["type"] = click.Choice(info.choices)
    elif annotation.removesuffix("|None") in ("int", "float"):
        kwargs["type"] = _number(annotation.removesuffix("|None"), info)
    return click.option(flag, option_name(declared, info), **kwargs)


def _number(kind: str, info: SettingInfo) -> click.ParamType:
    if info.low is None and info.high is None:
        return click.INT if kind == "int" else click.FLOAT
    if kind == "int":
        low = int(info.low) if info.low is not None else None
        high = int(info.high) if info.high is not None else None
        return click.IntRange(min=low, max=high, min_open=info.low_open)
    return click.FloatRange(min=info.low, max=info.high, min_open=info.low_open)


def _default(declared: Field[Any]) -> Any:
    if declared.default is not MISSING:
        return declared.default
    if callable(declared.default_factory):
        return declared.default_factory()
    raise ValueError(f"the setting {declared.name} has no default")
