"""What a worker connection asks of the models' owner: which model a worker serves, and
whether the gateway has that model's vocabulary.

The pool and its clients speak the protocol; the vocabularies and chat templates live in the
layers above (gateway/models/), which implement ModelDirectory. A client serves with a worker
only once the directory names its model and holds its vocabulary: a gateway never serves a
worker whose vocabulary it has not got.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ...protocol.messages import ModelInfo


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a worker's model goes: its served name, or why the gateway refuses it."""

    name: str
    problem: str | None = None


class ModelDirectory(Protocol):
    def place(self, info: ModelInfo) -> Placement:
        """The model a worker serves, by its ModelInfo (its name, its vocabulary)."""
        ...

    def is_ready(self, name: str, fingerprint: str) -> bool:
        """Whether requests for `name` with this vocabulary can be prepared now."""
        ...

    def has_vocabulary(self, fingerprint: str) -> bool:
        """Whether the gateway holds the vocabulary with this fingerprint."""
        ...

    async def prepare(self, name: str, fingerprint: str, gguf_zlib: bytes | None) -> str | None:
        """Make `name` ready: load a worker's VocabFile (gguf_zlib), unless the vocabulary is
        here already (None), and its chat template; why it is unusable, or None."""
        ...


@dataclass(frozen=True, slots=True)
class OneVocabulary:
    """A directory of one model whose vocabulary the gateway has: every worker with that
    vocabulary serves it, under the gateway's name for it. For tests of the pool alone."""

    name: str
    vocab_size: int
    fingerprint: str

    def place(self, info: ModelInfo) -> Placement:
        return place_on_one(self.name, self.vocab_size, self.fingerprint, info)

    def is_ready(self, name: str, fingerprint: str) -> bool:
        return fingerprint == self.fingerprint

    def has_vocabulary(self, fingerprint: str) -> bool:
        return fingerprint == self.fingerprint

    async def prepare(self, name: str, fingerprint: str, gguf_zlib: bytes | None) -> str | None:
        return "this gateway serves one vocabulary only"


def place_on_one(name: str, vocab_size: int, fingerprint: str, info: ModelInfo) -> Placement:
    """A gateway of one model file: every worker serves it, if its vocabulary is the same."""
    if info.vocab_size != vocab_size or info.vocab_fingerprint != fingerprint:
        return Placement(
            name,
            f"the worker's model {info.model_name!r} has a different vocabulary "
            f"({info.vocab_size} tokens) from this gateway's {name!r} "
            f"({vocab_size} tokens); start both with the same model file",
        )
    return Placement(name)
