"""The metadata-only GGUF a worker sends its gateways: llama.cpp loads it vocab-only and
tokenizes exactly as from the model file; a gateway refuses one that is not what the worker
announced."""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import pytest

from loomserve.gateway.config import GatewayConfig
from loomserve.gateway.models.catalogue import Catalogue
from loomserve.gateway.text.tokenizer import Vocab
from loomserve.protocol.messages import PROTOCOL_VERSION, ModelInfo
from loomserve.worker.engine.vocab_file import compressed_metadata, metadata_only


def test_the_metadata_alone_is_the_same_vocabulary(tmp_path: Path, other_model_path: Path) -> None:
    data = metadata_only(other_model_path)
    assert len(data) < other_model_path.stat().st_size / 2  # no weights
    assert len(data) % 32 == 0
    copy = tmp_path / "vocab.gguf"
    copy.write_bytes(data)
    whole, alone = Vocab(other_model_path), Vocab(copy)
    try:
        assert alone.fingerprint() == whole.fingerprint()
        assert alone.chat_template == whole.chat_template
        assert alone.meta("general.architecture") == "llama"
        text = "once upon a time w5 hello"
        assert alone.tokenize(text, True) == whole.tokenize(text, True)
    finally:
        whole.close()
        alone.close()
    assert zlib.decompress(compressed_metadata(other_model_path)) == data


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        metadata_only(bogus)


def test_a_gateway_refuses_a_vocabulary_it_was_not_promised(
    tiny_model_path: Path, other_model_path: Path
) -> None:
    """The catalogue loads a VocabFile only when its vocabulary has the fingerprint the
    worker announced, and garbage not at all; a good one makes the model servable."""
    catalogue = Catalogue(GatewayConfig(worker_endpoints=("ipc:///nowhere",)))
    tiny = Vocab(tiny_model_path)
    fingerprint = tiny.fingerprint()
    tiny.close()
    try:
        wrong = compressed_metadata(other_model_path)  # another model's
        problem = asyncio.run(catalogue.prepare("a", fingerprint, wrong))
        assert problem is not None and "not the one the worker announced" in problem
        assert not catalogue.has_vocabulary(fingerprint)
        garbage = asyncio.run(catalogue.prepare("a", fingerprint, b"not zlib"))
        assert garbage is not None and "inflate" in garbage
        assert asyncio.run(catalogue.prepare("a", fingerprint, None)) is not None
        right = compressed_metadata(tiny_model_path)
        assert asyncio.run(catalogue.prepare("a", fingerprint, right)) is None
        assert catalogue.get("a") is None  # no worker placed "a": nothing to serve yet
        assert catalogue.has_vocabulary(fingerprint)
    finally:
        catalogue.close()


def test_two_names_of_one_vocabulary_load_it_once(tiny_model_path: Path) -> None:
    """Two workers serving one file under two names (compose's embeddings profile) answer
    the gateway's queries at once: the vocabulary is loaded once and both names serve."""
    catalogue = Catalogue(GatewayConfig(worker_endpoints=("ipc:///nowhere",)))
    tiny = Vocab(tiny_model_path)
    fingerprint = tiny.fingerprint()
    tiny.close()
    data = compressed_metadata(tiny_model_path)
    loads: list[str] = []
    load = catalogue._load_vocabulary

    def counted(fingerprint: str, gguf_zlib: bytes) -> Vocab:
        loads.append(fingerprint)
        return load(fingerprint, gguf_zlib)

    async def all_three() -> list[str | None]:
        for name in ("chat", "embed", "third"):
            info = ModelInfo(PROTOCOL_VERSION, name, 0, 0, 0, 1, fingerprint, ready=True)
            assert catalogue.place(info).problem is None
        # The third comes without the file, as a worker's does once the gateway has it.
        return await asyncio.gather(
            catalogue.prepare("chat", fingerprint, data),
            catalogue.prepare("embed", fingerprint, data),
            catalogue.prepare("third", fingerprint, None),
        )

    catalogue._load_vocabulary = counted  # type: ignore[method-assign]
    try:
        assert asyncio.run(all_three()) == [None, None, None]
        assert loads == [fingerprint]
        served = [catalogue.get(name) for name in ("chat", "embed", "third")]
        assert all(model is not None for model in served)
        assert len({id(model.vocab) for model in served if model is not None}) == 1
    finally:
        catalogue.close()
