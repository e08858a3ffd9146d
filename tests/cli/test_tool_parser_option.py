"""--tool-call-parser: a family's name or auto, checked at start-up with the names."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from loomserve.cli.options import build_gateway_config
from loomserve.gateway.config import GatewayConfig
from loomserve.gateway.models.catalogue import ServedModel
from loomserve.gateway.text.tokenizer import Vocab
from tests.cli.test_cli import parse


def config(tiny_model_path: Path, *args: str) -> GatewayConfig:
    params = parse("gateway", ["--model", str(tiny_model_path), *args])
    return build_gateway_config(params.pop("worker_endpoint"), **params)


def test_a_named_family_is_the_models_call_syntax(tiny_model_path: Path) -> None:
    assert config(tiny_model_path).tool_call_parser == "auto"
    gateway = config(tiny_model_path, "--tool-call-parser", "qwen3_coder")
    served = ServedModel.build("tiny", Vocab(tiny_model_path), gateway)
    assert served.template_tools.format.name == "qwen3_coder"
    # auto: the tiny model has no template; its stand-in knows no tools
    served = ServedModel.build("tiny", Vocab(tiny_model_path), config(tiny_model_path))
    assert served.template_tools.format.name == "generic"


def test_an_unknown_family_is_refused_with_the_names(tiny_model_path: Path) -> None:
    with pytest.raises(click.BadParameter, match=r"auto, hermes, qwen3_coder, .*harmony"):
        config(tiny_model_path, "--tool-call-parser", "qwen4")
