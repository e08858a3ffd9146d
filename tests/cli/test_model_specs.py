"""--model PATH / NAME=PATH and --models-dir: which files, under which names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loomserve.cli.default_model import ModelFileError, NamedModel, named_models


def test_names_come_from_the_option_or_the_file(tiny_model_path: Path, tmp_path: Path) -> None:
    other = shutil.copy(tiny_model_path, tmp_path / "second.gguf")
    assert named_models([str(tiny_model_path)]) == [
        NamedModel("tiny-llama", tiny_model_path, False)
    ]
    assert named_models([f"chat={tiny_model_path}", str(other)]) == [
        NamedModel("chat", tiny_model_path, True),
        NamedModel("second", Path(other), False),
    ]
    # A path with an `=` in it that exists is a path.
    odd = Path(shutil.copy(tiny_model_path, tmp_path / "a=b.gguf"))
    assert named_models([str(odd)]) == [NamedModel("a=b", odd, False)]


def test_a_models_dir_serves_every_gguf_by_its_stem(tiny_model_path: Path, tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model_path, folder / "b.gguf")
    shutil.copy(tiny_model_path, folder / "a.gguf")
    (folder / "notes.txt").write_text("not a model")
    found = named_models([], folder)
    assert [model.name for model in found] == ["a", "b"]
    with pytest.raises(ModelFileError, match="two models are named 'a'"):
        named_models([f"a={tiny_model_path}"], folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFileError, match=r"holds no \.gguf"):
        named_models([], empty)


def test_bad_names_and_files_are_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="cannot name a model"):
        named_models([f"bad name={tiny_model_path}"])
    with pytest.raises(ModelFileError, match="no model file"):
        named_models([f"x={tmp_path / 'missing.gguf'}"])
    text = tmp_path / "text.gguf"
    text.write_text("hello")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        named_models([str(text)])


def test_a_models_dir_pairs_each_model_with_its_projector(
    tiny_model_path: Path, tiny_mmproj_path: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model_path, folder / "vision.gguf")
    shutil.copy(tiny_model_path, folder / "text.gguf")
    shutil.copy(tiny_mmproj_path, folder / "mmproj-vision.gguf")
    found = {model.name: model for model in named_models([], folder)}
    assert sorted(found) == ["text", "vision"]  # a projector is no model of its own
    assert found["vision"].mmproj == folder / "mmproj-vision.gguf"
    assert found["text"].mmproj is None
