"""Shared fixtures: the tiny generated model every fast engine test runs on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import ModelShape, write_tiny_model

LONG_CTX = 16384  # an ignore_eos generation this long keeps a slot busy for seconds


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama-architecture GGUF, written once per test session."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def long_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 16k context: same vocabulary, much longer generations."""
    path = tmp_path_factory.mktemp("long") / "tiny-long.gguf"
    return write_tiny_model(path, shape=ModelShape(context_length=LONG_CTX))
