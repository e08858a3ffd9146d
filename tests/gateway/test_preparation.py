"""ModelPreparation without a socket: placing a worker's model and fetching its vocabulary."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from loomserve.gateway.workers.directory import Placement
from loomserve.gateway.workers.preparation import ModelPreparation
from loomserve.protocol.messages import (
    PROTOCOL_VERSION,
    Message,
    ModelInfo,
    VocabFile,
    VocabQuery,
)

INFO = ModelInfo(PROTOCOL_VERSION, "m", 100, 1024, 512, 2, "fp-1", True)


@dataclass
class Learning:
    """A directory that has a vocabulary only once a worker sent it (as `serve`'s gateway)."""

    loaded: set[str] = field(default_factory=set)
    problem: str | None = None  # what loading a VocabFile answers

    def place(self, info: ModelInfo) -> Placement:
        return Placement(info.model_name)

    def is_ready(self, name: str, fingerprint: str) -> bool:
        return fingerprint in self.loaded

    def has_vocabulary(self, fingerprint: str) -> bool:
        return fingerprint in self.loaded

    async def prepare(self, name: str, fingerprint: str, gguf_zlib: bytes | None) -> str | None:
        if self.problem is None:
            self.loaded.add(fingerprint)
        return self.problem


def test_a_vocabulary_is_asked_of_the_worker_once_and_loaded() -> None:
    async def scenario() -> None:
        sent: list[Message] = []
        directory = Learning()
        preparation = ModelPreparation(directory, "tcp://w:1", lambda m: sent.append(m) or True)
        assert preparation.place(INFO) == ("m", None)
        assert sent == [VocabQuery("fp-1")] and preparation.wanted == "fp-1"
        preparation.on_vocab_file(VocabFile("fp-0", b"old"), "m")  # an earlier Hello's answer
        assert not preparation.tasks
        preparation.on_vocab_file(VocabFile("fp-1", b"gguf"), "m")
        await asyncio.gather(*preparation.tasks)
        assert preparation.wanted is None and preparation.refused is None
        assert directory.loaded == {"fp-1"}
        assert preparation.place(INFO) == ("m", None) and len(sent) == 1  # ready: nothing to ask

    asyncio.run(scenario())


def test_a_vocabulary_that_cannot_be_used_refuses_the_worker_until_its_next_hello() -> None:
    async def scenario() -> None:
        directory = Learning(problem="not a GGUF file")
        preparation = ModelPreparation(directory, "tcp://w:1", lambda m: True)
        preparation.place(INFO)
        preparation.on_vocab_file(VocabFile("fp-1", b"junk"), "m")
        await asyncio.gather(*preparation.tasks)
        assert preparation.refused == "cannot use the worker's vocabulary: not a GGUF file"
        assert preparation.wanted is None
        preparation.place(replace(INFO, vocab_fingerprint="fp-2"))  # the worker came back
        assert preparation.refused is None and preparation.wanted == "fp-2"
        preparation.on_vocab_file(VocabFile("fp-2", b"", "too large to send"), "m")
        assert preparation.refused == "cannot use the worker's vocabulary: too large to send"

    asyncio.run(scenario())


def test_a_worker_of_another_protocol_is_refused_and_not_placed() -> None:
    preparation = ModelPreparation(Learning(), "tcp://w:1", lambda m: True)
    name, problem = preparation.place(replace(INFO, protocol_version=PROTOCOL_VERSION - 1))
    assert name is None and problem is not None
    assert f"speaks protocol {PROTOCOL_VERSION - 1}, this gateway {PROTOCOL_VERSION}" in problem
    assert preparation.wanted is None
