"""--model PATH / NAME=PATH and --models-dir: which files, under which names."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loomserve.cli.default_model import ModelFileError, NamedModel, named_models, pair_projectors


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


def test_serve_mmproj_pairs_projectors_by_name(
    tiny_model_path: Path, tiny_mmproj_path: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model_path, folder / "dir.gguf")
    shutil.copy(tiny_mmproj_path, folder / "mmproj-dir.gguf")
    other = Path(shutil.copy(tiny_mmproj_path, tmp_path / "other-mmproj.gguf"))
    models = named_models([f"vision={tiny_model_path}", f"text={tiny_model_path}"], folder)
    paired = {m.name: m.mmproj for m in pair_projectors(models, [f"vision={tiny_mmproj_path}"])}
    assert paired == {"vision": tiny_mmproj_path, "text": None, "dir": folder / "mmproj-dir.gguf"}
    # NAME=PATH overrides the folder's pairing; a lone PATH is the one model's.
    paired = {m.name: m.mmproj for m in pair_projectors(models, [f"dir={other}"])}
    assert paired["dir"] == other
    (one,) = pair_projectors(named_models([str(tiny_model_path)]), [str(tiny_mmproj_path)])
    assert one.mmproj == tiny_mmproj_path
    with pytest.raises(ModelFileError, match="name the one it is for"):
        pair_projectors(models, [str(tiny_mmproj_path)])
    with pytest.raises(ModelFileError, match="no model is named 'nope'"):
        pair_projectors(models, [f"nope={tiny_mmproj_path}"])
    with pytest.raises(ModelFileError, match="two projectors for the model 'text'"):
        pair_projectors(models, [f"text={tiny_mmproj_path}", f"text={other}"])
    with pytest.raises(ModelFileError, match="no model file"):
        pair_projectors(models, [f"text={tmp_path / 'missing.gguf'}"])
