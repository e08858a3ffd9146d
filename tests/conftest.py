"""Shared fixtures: the tiny generated model every fast engine test runs on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama-architecture GGUF, written once per test session."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")
