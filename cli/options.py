"""Click options made from the config dataclasses' settings (protocol/settings.py), the
options the commands share, and the configs built from a command's option values.

Each field declared with `setting(...)` becomes one option: its flag from the field's name
(or the setting's `flag`), its default the field's, its type from the annotation and the
setting's range or choices, its help the setting's. A config built from the options takes
every such field from the option of the same name (`settings_from`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

import click

from ..gateway.config import (
    GatewayConfig,
    check_api_key,
    parse_key_file,
    parse_template_kwargs,
    unnamed_key_tenant,
)
from ..gateway.tools.format import PARSER_NAMES
from ..protocol.settings import SettingInfo, setting_info
from ..worker.config import WorkerConfig
from .default_model import named_models, resolve_model
from .tracing import traces_url

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


# Every command's: options read LOOMSERVE_<OPTION> from the environment, so compose files and
# the command line share one set of names.
CONTEXT_SETTINGS = {
    "auto_envvar_prefix": "LOOMSERVE",
    "show_default": True,
    "help_option_names": ["-h", "--help"],
}


def settings_of(config: type, alone: bool | None = None) -> list[tuple[Field[Any], SettingInfo]]:
    """The fields of a config dataclass that are settings, in declaration order; with
    `alone`, only those that are (True) or are not (False) for the process run alone."""
    found = []
    for declared in fields(config):
        info = setting_info(declared)
        if info is not None and (alone is None or info.alone == alone):
            found.append((declared, info))
    return found


def option_name(declared: Field[Any], info: SettingInfo) -> str:
    """The name click gives the option's value: the flag's, without dashes."""
    flag = info.flag or "--" + declared.name.replace("_", "-")
    return flag.removeprefix("--").replace("-", "_")


def options_from(config: type, alone: bool = False) -> Decorator:
    """A decorator adding an option for each of the config's settings: those shared with
    `serve`, or (alone) those of the process run alone."""
    made = [_option(declared, info) for declared, info in settings_of(config, alone)]

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
    if info.path is not None:
        kwargs["type"] = click.Path(exists=True, dir_okay=info.path == "any", path_type=Path)
    elif annotation.startswith("tuple["):
        kwargs["multiple"] = True
    elif info.choices is not None:
        kwargs["type"] = click.Choice(info.choices)
    elif annotation.removesuffix("|None") in ("int", "float"):
        kwargs["type"] = _number(annotation.removesuffix("|None"), info)
    return click.option(flag, *info.aliases, option_name(declared, info), **kwargs)


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


# --- the commands' shared options, and the configs built from them -----------------


def default_of(config: type, name: str) -> Any:
    """A setting's default, declared once: on its config dataclass."""
    setting = next(f for f in fields(config) if f.name == name)
    if setting.default is not MISSING:
        return setting.default
    if callable(setting.default_factory):  # MISSING, when there is none, is not callable
        return setting.default_factory()
    raise ValueError(f"{config.__name__}.{name} has no default")


class ApiKey(click.ParamType):
    """An API key: no whitespace, so that the flag, LOOMSERVE_API_KEY and a key file agree.

    The environment variable holds one key a line (click would split it on any whitespace,
    turning `open sesame` into two keys).
    """

    name = "key"

    def split_envvar_value(self, rv: str) -> list[str]:
        return [line.strip() for line in rv.splitlines() if line.strip()]

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        try:
            return check_api_key(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def worker_options(func):
    """The options that configure the worker; shared by `worker` and `serve`. Declared on
    WorkerConfig's fields (help, ranges, choices: protocol/settings.py)."""
    return options_from(WorkerConfig)(func)


def gateway_options(func):
    """The options that configure a gateway; shared by `gateway` and `serve`. Declared on
    GatewayConfig's fields, but for the API keys and the chat template, which the config
    holds parsed (key -> tenant, the template's text)."""
    options = [
        click.option(
            "--api-key",
            type=ApiKey(),
            multiple=True,
            help="Accepted API key (repeatable; no whitespace; the environment variable takes "
            "one a line). Without any, no key is needed.",
        ),
        click.option(
            "--api-key-file",
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            help="File of accepted API keys, one per line: `name:key` names the key's tenant "
            "(for fair shares and metrics), a bare key is a tenant of its own; "
            "`priority=MIN..MAX` after a key bounds its requests' priority; `role=admin` lets "
            "it see every tenant's requests in /slots; `#` starts a comment line.",
        ),
        click.option(
            "--chat-template",
            default=None,
            help="Chat template overriding the model's own: a llama.cpp built-in name (gemma, "
            "llama3, chatml, ...), Jinja text, or a file of Jinja; anything else, or Jinja "
            "that does not compile, is refused at start-up.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return options_from(GatewayConfig)(func)


def curve_client_options(func):
    """The keys of a CURVE client of the worker; shared by `gateway` and `worker-health`."""
    key_file = click.Path(exists=True, dir_okay=False, path_type=Path)
    options = [
        click.option(
            "--curve-server-key-file",
            type=key_file,
            default=default_of(GatewayConfig, "curve_server_key_file"),
            help="The worker's public CURVE certificate (.key); with the next, CURVE is on.",
        ),
        click.option(
            "--curve-secret-key-file",
            type=key_file,
            default=default_of(GatewayConfig, "curve_secret_key_file"),
            help="This client's CURVE certificate (.key_secret); the worker must allow its key.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def tracing_options(func):
    """Where request traces go; shared by `worker`, `gateway` and `serve` (cli/tracing.py)."""
    return click.option(
        "--otlp-endpoint",
        default=None,
        help="Export request traces (OpenTelemetry, OTLP over HTTP) to this collector "
        "(http://HOST:4318; /v1/traces is added). Default: the standard "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else off.",
    )(func)


def log_options(func):
    func = click.option(
        "--log-json/--no-log-json",
        default=None,
        help="JSON log lines. Default: on when stderr is not a terminal.",
    )(func)
    return click.option("--log-level", default="info", help="Log level.")(func)


def build_worker_config(bind: str, **opts) -> WorkerConfig:
    """A WorkerConfig from the command's options: every field an option of the same name sets."""
    settings = {f.name: opts[f.name] for f in fields(WorkerConfig) if f.name in opts}
    try:
        settings.update(model_path=resolve_model(opts["model"]), bind=bind)
        return WorkerConfig(**settings)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def build_gateway_config(workers: str | tuple[str, ...], **opts) -> GatewayConfig:
    """A GatewayConfig from the command's options and the worker endpoints."""
    keys = {key: unnamed_key_tenant(key) for key in opts["api_key"]}
    priorities = {}
    admins: frozenset[str] = frozenset()
    if opts["api_key_file"]:
        path = opts["api_key_file"]
        try:
            key_file = parse_key_file(Path(path).read_text())
        except ValueError as exc:
            raise click.BadParameter(f"{path}: {exc}", param_hint="--api-key-file") from None
        keys.update(key_file.tenants)
        priorities = key_file.priorities
        admins = key_file.admins
    template = opts["chat_template"]
    template_from = ""
    if template:
        from ..gateway.text.chat_template import (  # loads llama.cpp
            load_override,
            override_origin,
        )

        template_from = override_origin(template)
        template = load_override(template)
    parser = opts.get("reasoning_parser")
    if parser and parser not in ("auto", "none"):
        from ..gateway.text.reasoning import family_named

        try:
            family_named(parser)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--reasoning-parser") from None
    try:
        parse_template_kwargs(opts.get("chat_template_kwargs") or "")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--chat-template-kwargs") from None
    tool_parser = opts.get("tool_call_parser") or "auto"
    if tool_parser not in PARSER_NAMES:
        raise click.BadParameter(
            f"unknown tool-call parser {tool_parser!r}; one of: {', '.join(PARSER_NAMES)}",
            param_hint="--tool-call-parser",
        )
    files = named_models(opts["model"])
    one = len(files) == 1 and not files[0].named
    return GatewayConfig(
        **settings_from(GatewayConfig, opts),
        model_path=files[0].path if one else None,
        models=() if one else tuple((model.name, model.path) for model in files),
        models_control=opts.get("models_control"),
        worker_endpoints=(workers,) if isinstance(workers, str) else tuple(workers),
        api_keys=keys,
        key_priorities=priorities,
        admin_keys=admins,
        chat_template=template,
        chat_template_from=template_from,
        curve_server_key_file=opts.get("curve_server_key_file"),
        curve_secret_key_file=opts.get("curve_secret_key_file"),
        otlp_endpoint=traces_url(opts.get("otlp_endpoint")),
    )
