"""ModelPreparation: which model a worker serves here, by its ModelInfo, and making it ready.

A worker that speaks another protocol, or whose model the directory (directory.py) refuses,
gets no requests. Until the gateway holds the model's vocabulary and chat template the worker
stays out of rotation too. They come from the gateway's own files, or from the worker: a
VocabQuery, answered by a VocabFile, which the directory loads off the event loop. A
vocabulary the gateway cannot use keeps the worker out until it says Hello as another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from ...protocol.messages import (
    PROTOCOL_VERSION,
    Message,
    ModelInfo,
    VocabFile,
    VocabQuery,
)
from .directory import ModelDirectory

log = structlog.get_logger(__name__)


class ModelPreparation:
    """One worker connection's preparation of its model: what it waits for, or why it failed."""

    def __init__(
        self, directory: ModelDirectory, endpoint: str, send: Callable[[Message], bool]
    ) -> None:
        self.directory = directory
        self.endpoint = endpoint  # the worker's address, for the log
        self._send = send
        self.wanted: str | None = None  # the vocabulary fingerprint still being prepared
        self.refused: str | None = None  # why the worker's vocabulary cannot be served
        self.tasks: list[asyncio.Task] = []  # loading a vocabulary; the client stops them

    def place(self, info: ModelInfo) -> tuple[str | None, str | None]:
        """A new ModelInfo: the name its model is served under here (None when it cannot be),
        and why the gateway refuses to serve with the worker. Starts preparing the model."""
        self.wanted = None  # what was wanted for the ModelInfo before no longer matters
        self.refused = None
        if info.protocol_version != PROTOCOL_VERSION:
            return None, (
                f"the worker speaks protocol {info.protocol_version}, this gateway "
                f"{PROTOCOL_VERSION}; run matching versions"
            )
        placement = self.directory.place(info)
        if placement.problem is None:
            self._start(placement.name, info.vocab_fingerprint)
        return placement.name, placement.problem

    def _start(self, model: str, fingerprint: str) -> None:
        """Out of rotation until the gateway has the model's vocabulary and chat template:
        from its own files, or from the worker (VocabQuery, answered by a VocabFile)."""
        if self.directory.is_ready(model, fingerprint):
            return
        self.wanted = fingerprint
        if self.directory.has_vocabulary(fingerprint):
            self._start_prepare(model, fingerprint, None)
        else:
            log.info("fetching the worker's vocabulary", worker=self.endpoint, model=model)
            self._send(VocabQuery(fingerprint))

    def on_vocab_file(self, answer: VocabFile, model: str | None) -> None:
        """The worker's answer to our VocabQuery, for the model it now serves as `model`."""
        if answer.vocab_fingerprint != self.wanted or model is None:
            return  # an answer to an earlier Hello's query
        if answer.error:
            self._refuse(answer.error)
            return
        self._start_prepare(model, answer.vocab_fingerprint, answer.gguf_zlib)

    def _start_prepare(self, model: str, fingerprint: str, gguf_zlib: bytes | None) -> None:
        task = asyncio.create_task(self._prepare(model, fingerprint, gguf_zlib), name="prepare")
        self.tasks = [task, *(other for other in self.tasks if not other.done())]

    async def _prepare(self, model: str, fingerprint: str, gguf_zlib: bytes | None) -> None:
        problem = await self.directory.prepare(model, fingerprint, gguf_zlib)
        if self.wanted != fingerprint:
            return  # the worker went away, or came back as another, meanwhile
        if problem is not None:
            self._refuse(problem)
            return
        self.wanted = None
        log.info("model ready to serve", worker=self.endpoint, model=model)

    def _refuse(self, why: str) -> None:
        self.wanted = None
        self.refused = f"cannot use the worker's vocabulary: {why}"
        log.error("refusing to serve with this worker", worker=self.endpoint, reason=why)
