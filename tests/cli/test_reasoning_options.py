"""--reasoning-parser and --chat-template-kwargs: checked at start-up, with the names."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from loomserve.cli.options import build_gateway_config
from loomserve.gateway.config import GatewayConfig
from tests.cli.test_cli import parse


def config(tiny_model_path: Path, *args: str) -> GatewayConfig:
    params = parse("gateway", ["--model", str(tiny_model_path), *args])
    return build_gateway_config(params.pop("worker_endpoint"), **params)


def test_a_known_parser_and_kwargs_are_taken(tiny_model_path: Path) -> None:
    gateway = config(
        tiny_model_path,
        "--reasoning-parser",
        "qwen3",
        "--chat-template-kwargs",
        '{"enable_thinking": false}',
    )
    assert gateway.reasoning_parser == "qwen3"
    assert gateway.template_kwargs() == {"enable_thinking": False}
    assert config(tiny_model_path).reasoning_parser == "auto"


def test_an_unknown_parser_is_refused_with_the_names(tiny_model_path: Path) -> None:
    with pytest.raises(click.BadParameter, match=r"auto, none, .*deepseek_r1.*gpt_oss"):
        config(tiny_model_path, "--reasoning-parser", "nope")


@pytest.mark.parametrize("value", ["[1]", "{not json", '"text"'])
def test_kwargs_that_are_not_an_object_are_refused(tiny_model_path: Path, value: str) -> None:
    with pytest.raises(click.BadParameter, match="--chat-template-kwargs"):
        config(tiny_model_path, "--chat-template-kwargs", value)
