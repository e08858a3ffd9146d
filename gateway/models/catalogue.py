"""The models a gateway serves: each one's vocabulary, chat template, tools and defaults.

A model comes from one of two places:
- **the gateway's own files** (`--model NAME=PATH`): its vocabulary is loaded at start-up,
  and a worker serves it when the worker's name is NAME (and its vocabulary the same). A
  single `--model PATH` without a name is the one-model gateway: every worker serves it,
  whatever its name, if its vocabulary is the same.
- **a worker** that serves a model the gateway has no file for: the gateway places it by the
  worker's name and loads its vocabulary from the worker's VocabFile (a GGUF without
  weights), so a deployment adds a model by adding workers, without the gateways' disks or
  restarts. All workers of one name must have one vocabulary.

The Catalogue is the pool's ModelDirectory (workers/directory.py): a worker is in rotation
only once its model is ready here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ...protocol.messages import ModelInfo, SamplingParams
from ..config import GatewayConfig
from ..request.params import model_sampling_defaults
from ..text.chat_template import Renderer, choose_template
from ..text.reasoning import MarkerText, ReasoningFamily, choose_family
from ..text.tokenizer import Pieces, Vocab
from ..tools.checks import MarkerPieces
from ..tools.template import TemplateTools
from ..workers.directory import Placement, place_on_one

log = structlog.get_logger(__name__)

MAX_VOCAB_FILE_BYTES = 512 * 1024 * 1024  # a VocabFile inflating past this is refused


@dataclass(slots=True)
class ServedModel:
    """One model as requests use it: text in and out, its template, its tools' syntax."""

    name: str
    vocab: Vocab
    template: Renderer
    template_tools: TemplateTools  # what the template renders of tools; the call syntax
    # The vocabulary's pieces, with control-token call (and reasoning) markers as text.
    tool_pieces: Pieces
    # What a request's unset sampling fields become: the model's defaults or neutral ones.
    sampling_defaults: SamplingParams
    fingerprint: str
    # The think-block markers of its replies (--reasoning-parser, or its template's); None:
    # its replies are all answer.
    reasoning: ReasoningFamily | None = None
    # --chat-template-kwargs: every render's variables, under a request's own.
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The vocabulary's pieces with the reasoning markers' control tokens written out.
    text_pieces: Pieces | None = None
    reasoning_budget: int = -1  # --reasoning-budget: a reply's thinking tokens (-1: none)

    def pieces(self, tools: bool) -> Pieces:
        """What a chat reply's tokens read as: the reasoning markers, and with tools the call
        markers, written out where they are control tokens."""
        if tools:
            return self.tool_pieces
        return self.text_pieces or self.vocab

    @classmethod
    def build(cls, name: str, vocab: Vocab, config: GatewayConfig) -> ServedModel:
        """Choose the chat template and probe it, read the defaults; ValueError when the
        template does not compile. Seconds for a large vocabulary: not on the event loop."""
        chosen = choose_template(
            config.chat_template, vocab.chat_template, vocab.architecture, vocab.bos_text,
            vocab.eos_text,
        )  # fmt: skip
        if chosen.fallback:
            log.warning(
                "the model ships no chat template; chats use a stand-in",
                model=name,
                template=chosen.origin,
                architecture=vocab.architecture or "unknown",
                override="--chat-template (a llama.cpp built-in name, Jinja text or a file)",
            )
        template_tools = TemplateTools.probe(chosen.renderer, config.tool_call_parser)
        reasoning = choose_family(config.reasoning_parser, chosen.renderer.source)
        log.info(
            "chat template",
            model=name,
            template=config.chat_template_from or chosen.origin,
            tool_format=template_tools.format.name,
            reasoning=reasoning.name if reasoning else "none",
        )
        tool_pieces = MarkerPieces(vocab, template_tools.format).pieces()
        return cls(
            name,
            vocab,
            chosen.renderer,
            template_tools,
            MarkerText.over(tool_pieces, vocab, reasoning),
            _sampling_defaults(name, config, vocab),
            vocab.fingerprint(),
            reasoning,
            config.template_kwargs(),
            MarkerText.over(vocab, vocab, reasoning),
            config.reasoning_budget,
        )


def _sampling_defaults(name: str, config: GatewayConfig, vocab: Vocab) -> SamplingParams:
    """The defaults for a request's unset sampling fields, logged once per model."""
    found = model_sampling_defaults(vocab.meta) if config.model_sampling_defaults else {}
    defaults = dataclasses.replace(SamplingParams(), **found)
    source = "the model (general.sampling.*)" if found else "neutral"
    if not config.model_sampling_defaults:
        source = "neutral (--no-model-sampling-defaults)"
    log.info(
        "sampling defaults",
        model=name,
        source=source,
        temperature=defaults.temperature,
        top_k=defaults.top_k,
        top_p=defaults.top_p,
        min_p=defaults.min_p,
        repeat_penalty=defaults.repeat_penalty,
    )
    return defaults


class Catalogue:
    """Every model this gateway knows, by served name; the pool's ModelDirectory."""

    def __init__(self, config: GatewayConfig) -> None:
        """Load the vocabulary of each of the gateway's own model files (ValueError when one
        cannot be loaded, or its template does not compile)."""
        self.config = config
        self._vocabs: dict[str, Vocab] = {}  # by fingerprint
        self._files: dict[str, ServedModel] = {}  # the gateway's own files, by name
        self._learned: dict[str, ServedModel] = {}  # models learned from workers, by name
        self._learned_vocab: dict[str, str] = {}  # name -> the fingerprint its workers have
        self._preparing: dict[tuple[str, str], asyncio.Task[str | None]] = {}
        # One load per vocabulary, however many names its workers serve it under: two loads
        # of one fingerprint would write its file while the other reads it.
        self._loading: dict[str, asyncio.Task[Vocab]] = {}
        self._dir: Path | None = None  # where vocabularies from workers are written
        self.only: ServedModel | None = None  # the one-model gateway's model (--model PATH)
        # Several models: those whose file cannot be loaded, with why; the others serve.
        self.failed: dict[str, str] = {}
        try:
            for name, path in config.model_files():
                try:
                    self._load_file(name, path)
                except ValueError as exc:
                    if len(config.models) < 2:
                        raise
                    self.failed[name] = str(exc)
                    log.error(
                        "model unavailable: its file cannot be loaded; the others serve",
                        model=name,
                        path=str(path),
                        reason=str(exc),
                    )
            if self.failed and not self._files:
                raise ValueError("; ".join(self.failed.values()))
        except BaseException:
            self.close()
            raise
        if config.model_path is not None:
            self.only = self._files[config.served_model_name]

    def _load_file(self, name: str, path: Path) -> None:
        """Load one of the gateway's own files; ValueError when it cannot be."""
        vocab = Vocab(path)
        try:
            served = ServedModel.build(name, vocab, self.config)
        except BaseException:
            vocab.close()
            raise
        self._vocabs.setdefault(served.fingerprint, vocab)
        self._files[name] = served

    def close(self) -> None:
        """Free every vocabulary and the files written for them."""
        for vocab in self._vocabs.values():
            vocab.close()
        self._vocabs.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    # --- what requests see ----------------------------------------------------------

    def get(self, name: str) -> ServedModel | None:
        """The model served under `name`, once its vocabulary is here."""
        return self._files.get(name) or self._learned.get(name)

    def names(self) -> list[str]:
        """Every name known: the gateway's own models first, then the learned ones."""
        return [*self._files, *(name for name in self._learned_vocab if name not in self._files)]

    @property
    def default(self) -> ServedModel | None:
        """The model a request that names none gets: the first of the gateway's own, else
        the first learned, while it is the only one."""
        if self._files:
            return next(iter(self._files.values()))
        if len(self._learned) == 1:
            return next(iter(self._learned.values()))
        return None

    # --- ModelDirectory ---------------------------------------------------------------

    def place(self, info: ModelInfo) -> Placement:
        if self.only is not None:
            vocab = self._vocabs[self.only.fingerprint]
            return place_on_one(self.only.name, vocab.n_tokens, self.only.fingerprint, info)
        name = info.model_name
        own = self._files.get(name)
        if own is not None:
            if own.fingerprint != info.vocab_fingerprint:
                return Placement(
                    name,
                    f"the worker serves {name!r} with a different vocabulary from this "
                    f"gateway's file for it ({own.vocab.n_tokens} tokens, the worker's "
                    f"{info.vocab_size}); give both the same model file",
                )
            return Placement(name)
        known = self._learned_vocab.setdefault(name, info.vocab_fingerprint)
        if known != info.vocab_fingerprint:
            return Placement(
                name,
                f"the worker serves {name!r} with a different vocabulary from the other "
                f"workers of {name!r}; one name, one model",
            )
        return Placement(name)

    def is_ready(self, name: str, fingerprint: str) -> bool:
        model = self.get(name)
        return model is not None and model.fingerprint == fingerprint

    def has_vocabulary(self, fingerprint: str) -> bool:
        return fingerprint in self._vocabs

    async def prepare(self, name: str, fingerprint: str, gguf_zlib: bytes | None) -> str | None:
        # One preparation per model, however many of its workers ask at once.
        key = (name, fingerprint)
        task = self._preparing.get(key)
        if task is None:
            task = asyncio.create_task(self._prepare(name, fingerprint, gguf_zlib))
            self._preparing[key] = task
            task.add_done_callback(lambda _: self._preparing.pop(key, None))
        return await asyncio.shield(task)

    async def _prepare(self, name: str, fingerprint: str, gguf_zlib: bytes | None) -> str | None:
        try:
            vocab = await self._vocabulary(fingerprint, gguf_zlib)
            served = await asyncio.to_thread(ServedModel.build, name, vocab, self.config)
        except ValueError as exc:
            return str(exc)
        if self._learned_vocab.get(name) == fingerprint:
            self._learned[name] = served
            log.info("model learned from a worker", model=name, vocab_tokens=vocab.n_tokens)
        return None

    async def _vocabulary(self, fingerprint: str, gguf_zlib: bytes | None) -> Vocab:
        """The vocabulary with this fingerprint: here already, being loaded for another name,
        or loaded now from the worker's VocabFile (ValueError when none of these)."""
        vocab = self._vocabs.get(fingerprint)
        if vocab is not None:
            return vocab
        task = self._loading.get(fingerprint)
        if task is None:
            if gguf_zlib is None:
                raise ValueError("the worker's vocabulary is not here")
            task = asyncio.create_task(self._load(fingerprint, gguf_zlib))
            self._loading[fingerprint] = task
            task.add_done_callback(lambda _: self._loading.pop(fingerprint, None))
        return await asyncio.shield(task)

    async def _load(self, fingerprint: str, gguf_zlib: bytes) -> Vocab:
        vocab = await asyncio.to_thread(self._load_vocabulary, fingerprint, gguf_zlib)
        self._vocabs[fingerprint] = vocab
        return vocab

    def _load_vocabulary(self, fingerprint: str, gguf_zlib: bytes) -> Vocab:
        inflater = zlib.decompressobj()
        try:
            data = inflater.decompress(gguf_zlib, MAX_VOCAB_FILE_BYTES)
        except zlib.error as exc:
            raise ValueError(f"the VocabFile does not inflate: {exc}") from None
        if inflater.unconsumed_tail:
            raise ValueError(f"the VocabFile inflates past {MAX_VOCAB_FILE_BYTES} bytes")
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="loomserve-vocab-"))
        path = self._dir / f"{fingerprint[:32]}.gguf"
        path.write_bytes(data)
        vocab = Vocab(path)
        if vocab.fingerprint() != fingerprint:
            vocab.close()
            raise ValueError("the VocabFile's vocabulary is not the one the worker announced")
        return vocab
