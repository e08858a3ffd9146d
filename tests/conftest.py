"""Shared fixtures: the tiny generated model every fast engine test runs on."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import kill_leftovers
from tests.tiny_model import ModelShape, write_tiny_model
from tests.tiny_vision_model import TINY_GEMMA3, write_tiny_mmproj

LONG_CTX = 16384  # an ignore_eos generation this long keeps a slot busy for seconds
# Debian's Chromium (or LOOMSERVE_CHROMIUM): the browser the `browser` fixture drives.
CHROMIUM = os.environ.get("LOOMSERVE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama-architecture GGUF, written once per test session."""
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_mmproj_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA-style vision projector (mmproj GGUF) for the tiny model, written once."""
    return write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "mmproj-tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_gemma3_mmproj_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3-style projector (images attend both ways) for the tiny model."""
    folder = tmp_path_factory.mktemp("mmproj-gemma3")
    return write_tiny_mmproj(folder / "mmproj-tiny-gemma3.gguf", shape=TINY_GEMMA3)


@pytest.fixture(scope="session")
def other_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model: other weights, and 64 more pieces, so another vocabulary."""
    path = tmp_path_factory.mktemp("other") / "tiny-other.gguf"
    return write_tiny_model(path, seed=77, shape=ModelShape(extra_vocab=64))


@pytest.fixture(scope="session")
def long_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 16k context: same vocabulary, much longer generations."""
    path = tmp_path_factory.mktemp("long") / "tiny-long.gguf"
    return write_tiny_model(path, shape=ModelShape(context_length=LONG_CTX))


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """A headless Chromium from the system's package (Playwright's own download is out of
    reach), for pages people look at: the bench's report, the status page."""
    # CI (.ci/run) installs both and sets LOOMSERVE_REQUIRE_BROWSER: there a missing browser
    # fails the tests instead of skipping them.
    required = bool(os.environ.get("LOOMSERVE_REQUIRE_BROWSER"))
    if not Path(CHROMIUM).exists():
        message = f"no Chromium at {CHROMIUM}: apt-get install chromium"
        if required:
            pytest.fail(message)
        pytest.skip(message)
    if required:
        import playwright.sync_api as sync_api
    else:
        sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start; a container's
        # small /dev/shm would crash it without --disable-dev-shm-usage.
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        yield launched
        launched.close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Kill the servers a test left running (a Ctrl-C'd run's) as the session ends: before
    the interpreter's exit waits for threads (a thread pool's) still talking to them."""
    kill_leftovers()
