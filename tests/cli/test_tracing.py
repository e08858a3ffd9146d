"""Where traces go (cli/tracing.py): --otlp-endpoint, else the standard variables, else off."""

from __future__ import annotations

from loomserve.cli.main import main
from loomserve.cli.serve import child_argv
from loomserve.cli.tracing import traces_url


def test_off_unless_configured() -> None:
    assert traces_url(None, {}) is None
    assert traces_url("", {}) is None


def test_the_option_is_a_collectors_base_url() -> None:
    assert traces_url("http://jaeger:4318", {}) == "http://jaeger:4318/v1/traces"
    assert traces_url("http://jaeger:4318/", {}) == "http://jaeger:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces", {}) == "http://c:4318/v1/traces"


def test_the_standard_variables_as_the_spec_reads_them() -> None:
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert traces_url(None, base) == "http://c:4318/v1/traces"
    whole = {**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9999/custom"}
    assert traces_url(None, whole) == "http://t:9999/custom"  # as is, and before the base
    assert traces_url("http://o:4318", whole) == "http://o:4318/v1/traces"  # the option first


def test_the_sdk_switch_turns_it_off() -> None:
    env = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert traces_url("http://o:4318", env) is None


def test_serve_passes_the_endpoint_to_every_child() -> None:
    serve_options = [p.name for p in main.commands["serve"].params]
    assert serve_options.count("otlp_endpoint") == 1  # one option, for both kinds of child
    for command in ("worker", "gateway"):
        argv = child_argv(main.commands[command], {"otlp_endpoint": "http://jaeger:4318"})
        assert argv[-2:] == ["--otlp-endpoint", "http://jaeger:4318"], command
