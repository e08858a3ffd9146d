"""Reasoning output: each family's think-block markers, found in a chat template's text, and
a pure incremental splitter of a reply's text into its reasoning and its answer.

A family is described once (REASONING_FAMILIES): the marker that opens the think block,
the one that closes it, and text the answer may open with that is no part of it (gpt-oss's
final channel header). Whether a reply starts inside the block is read off the rendered
prompt (`starts_inside`): DeepSeek-R1's and Qwen3.5's templates end the prompt with
`<think>\n`, Qwen3's with enable_thinking false with a closed, empty block.

The splitter is fed text deltas and gives reasoning and content deltas, split exactly at the
markers even when a marker arrives cut across deltas: it holds back only a tail that may
still become a marker (and whitespace that trimming may drop). Fed whole or one character
at a time, it gives the same text. Only the first think block is reasoning: a marker later
in the answer stays in the answer.

A reply is split once: ReplySplit runs one splitter per choice as its tokens arrive
(generate/assembly.py), counts the tokens that fell in the think block, and shows the tools'
end the answer only; the stream's chunks and the whole response read its parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .stop import TextMatcher
from .tokenizer import Pieces, Vocab


@dataclass(frozen=True, slots=True)
class ReasoningFamily:
    """How one family of models marks its thinking."""

    name: str
    start: str  # opens the think block
    end: str  # closes it
    detect: tuple[str, ...]  # any of these in a template's text means this family
    # Text the answer may open with (after the block, or with no block at all) that only
    # frames it, dropped: gpt-oss's `<|start|>assistant<|channel|>final<|message|>`.
    content_prefixes: tuple[str, ...] = ()
    # Text that closes the answer (Apriel's `[END FINAL RESPONSE]`): dropped, and what follows.
    content_suffixes: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # vLLM's --reasoning-parser names for the same markers
    templates: str = ""  # which models' templates, for the docs

    def starts_inside(self, prompt: str) -> bool:
        """Whether a reply to this rendered prompt starts inside the think block (the
        template opened it)."""
        return prompt.rstrip().endswith(self.start.rstrip())


REASONING_FAMILIES: tuple[ReasoningFamily, ...] = (
    # Most specific first: detection takes the first family whose text the template has.
    ReasoningFamily(
        "gpt_oss",
        "<|channel|>analysis<|message|>",
        "<|end|>",
        ("<|channel|>analysis", "<|channel|>"),
        content_prefixes=(
            "<|start|>assistant<|channel|>final<|message|>",
            "<|channel|>final<|message|>",
        ),
        templates="gpt-oss (Harmony: the analysis channel is the reasoning)",
    ),
    ReasoningFamily(
        "seed_oss",
        "<seed:think>",
        "</seed:think>",
        ("<seed:think>",),
        templates="ByteDance Seed-OSS",
    ),
    ReasoningFamily(
        "mistral",
        "[THINK]",
        "[/THINK]",
        ("[THINK]",),
        aliases=("magistral",),
        templates="Magistral, Ministral-3 Reasoning",
    ),
    ReasoningFamily(
        "kimi_vl",
        "◁think▷",
        "◁/think▷",
        ("◁think▷",),
        templates="Kimi-VL Thinking",
    ),
    ReasoningFamily(
        "gemma4",
        "<|channel>thought",
        "<channel|>",
        ("<|channel>thought",),
        templates="Gemma 4",
    ),
    ReasoningFamily(
        "apriel",
        "Here are my reasoning steps:",
        "[BEGIN FINAL RESPONSE]",
        ("[BEGIN FINAL RESPONSE]",),
        content_suffixes=("[END FINAL RESPONSE]",),
        templates="Apriel 1.5 and 1.6 Thinker (the 1.6 prompt opens the reasoning)",
    ),
    ReasoningFamily(
        "solar_open",
        "<|think|>",
        "<|end|>",
        ("<|begin|>assistant<|think|>",),
        content_prefixes=("<|begin|>assistant<|content|>",),
        templates="Solar Open",
    ),
    ReasoningFamily(
        "command_r7b",
        "<|START_THINKING|>",
        "<|END_THINKING|>",
        ("<|START_THINKING|>",),
        content_prefixes=("<|START_RESPONSE|>",),
        templates="Command R7B, Command A Reasoning",
    ),
    ReasoningFamily(
        "deepseek_r1",
        "<think>",
        "</think>",
        ("<think>", "</think>"),
        aliases=("think", "qwen3", "glm45", "minimax_m2", "kimi_k2", "step3", "olmo3"),
        templates=(
            "Qwen3, Qwen3.5, QwQ, DeepSeek-R1 and V3.1+, GLM-4.5/4.6/4.7, SmolLM3, "
            "Nemotron Nano, Kimi-K2-Thinking, MiniMax-M2, MiniCPM5, LFM2.5, StepFun, "
            "Ling, Laguna and every template that writes `<think>`"
        ),
    ),
)


def family_names() -> list[str]:
    """Every name --reasoning-parser takes for a family (aliases too), sorted."""
    names = [n for family in REASONING_FAMILIES for n in (family.name, *family.aliases)]
    return sorted(names)


def family_named(name: str) -> ReasoningFamily:
    """The family a --reasoning-parser name means; ValueError listing the names otherwise."""
    for family in REASONING_FAMILIES:
        if name == family.name or name in family.aliases:
            return family
    raise ValueError(
        f"unknown reasoning parser {name!r}; the names: auto, none, {', '.join(family_names())}"
    )


def detect_family(template_source: str) -> ReasoningFamily | None:
    """The family whose markers the template's text writes, or None."""
    for family in REASONING_FAMILIES:
        if any(needle in template_source for needle in family.detect):
            return family
    return None


def choose_family(setting: str, template_source: str) -> ReasoningFamily | None:
    """--reasoning-parser: `auto` detects from the template, `none` turns it off, else a
    family by name (ValueError for an unknown one)."""
    if setting == "none":
        return None
    if setting == "auto":
        return detect_family(template_source)
    return family_named(setting)


Kind = Literal["reasoning", "content"]


@dataclass(slots=True)
class Split:
    """What one push gives: new reasoning text and new answer text (either may be "").
    Reasoning always comes before the answer within one push."""

    reasoning: str = ""
    content: str = ""


_START, _REASONING, _AFTER_END, _CONTENT, _ENDED = range(5)


@dataclass(slots=True)
class ReasoningSplitter:
    """Feed `push` a reply's text deltas, then call `finish` once (also when cut short).

    Reasoning is trimmed of the whitespace around it, and the answer of the whitespace
    before it, as llama-server trims them.
    """

    family: ReasoningFamily
    inside: bool = False  # the prompt opened the block: the reply starts in it
    _state: int = field(default=_START, init=False)
    _held: str = field(default="", init=False)
    _reasoned: bool = field(default=False, init=False)  # some reasoning text went out
    opened: bool = field(default=False, init=False)  # the reply had a think block

    @property
    def thinking(self) -> bool:
        """Whether the text so far has not left the think block (nor shown it has none)."""
        return self._state in (_START, _REASONING)

    def push(self, text: str) -> Split:
        """The reasoning and answer text that these characters make certain."""
        out = Split()
        self._held += text
        self._advance(out, final=False)
        return out

    def finish(self) -> Split:
        """What was held back, at the end of the reply: a reply cut inside the block leaves
        its reasoning only; a partial marker that never completed is text."""
        out = Split()
        self._advance(out, final=True)
        held, self._held = self._held, ""
        if self._state == _REASONING:
            self._add(out, "reasoning", held.rstrip())
        elif self._state in (_START, _AFTER_END) and held.strip():
            self._add(out, "content", held.lstrip())
        elif self._state == _CONTENT:
            self._add(out, "content", held)
        self._state = _ENDED
        return out

    def _advance(self, out: Split, final: bool) -> None:
        while True:
            held, family = self._held, self.family
            if self._state == _START:
                start = held.lstrip()
                if start.startswith(family.start):
                    self._held, self._state = start[len(family.start) :], _REASONING
                    self.opened = True
                    continue
                if not final and _may_become(start, (family.start, *family.content_prefixes)):
                    return
                self._state = _REASONING if self.inside else _AFTER_END
                self.opened = self.inside
                continue
            if self._state == _REASONING:
                if not self._reasoned:
                    held = self._held = held.lstrip()
                cut = held.find(family.end)
                if cut >= 0:
                    self._add(out, "reasoning", held[:cut].rstrip())
                    self._held, self._state = held[cut + len(family.end) :], _AFTER_END
                    continue
                body = held[: len(held) - _marker_tail(held, family.end)]
                sent = body.rstrip()  # trailing whitespace waits: the end may follow it
                self._add(out, "reasoning", sent)
                self._held = held[len(sent) :]
                return
            if self._state == _AFTER_END:
                answer = held.lstrip()
                prefix = next((p for p in family.content_prefixes if answer.startswith(p)), None)
                if prefix is not None:
                    self._held = answer[len(prefix) :]
                    continue
                if not final and _may_become(answer, (*family.content_prefixes, "")):
                    return  # whitespace only, or the start of a prefix
                self._held, self._state = answer, _CONTENT
                continue
            if self._state == _ENDED:
                self._held = ""  # after the answer's closing text: nothing more is answer
                return
            suffixes = family.content_suffixes
            cut = min((i for i in (held.find(s) for s in suffixes) if i >= 0), default=-1)
            if cut >= 0:
                self._add(out, "content", held[:cut])
                self._held, self._state = "", _ENDED
                return
            keep = 0 if final else max((_marker_tail(held, s) for s in suffixes), default=0)
            self._add(out, "content", held[: len(held) - keep])
            self._held = held[len(held) - keep :]
            return

    def _add(self, out: Split, kind: Kind, text: str) -> None:
        if not text:
            return
        if kind == "reasoning":
            out.reasoning += text
            self._reasoned = True  # its leading whitespace is trimmed: later whitespace is text
        else:
            out.content += text


def _may_become(text: str, markers: tuple[str, ...]) -> bool:
    """Whether text is still a (possibly empty) prefix of one of the markers."""
    return any(marker.startswith(text) for marker in markers)


def _marker_tail(text: str, marker: str) -> int:
    """Length of the longest tail of text that the marker starts with (not all of it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split_whole(family: ReasoningFamily, inside: bool, text: str) -> Split:
    """A whole reply split at once: the same as feeding it piece by piece."""
    splitter = ReasoningSplitter(family, inside)
    first, rest = splitter.push(text), splitter.finish()
    return Split(first.reasoning + rest.reasoning, first.content + rest.content)


@dataclass(slots=True)
class ReplySplit:
    """The one split of a chat reply's thinking from its answer, fed token by token the raw
    text the stop strings let through (assembly.py): every reader (stream chunks, the whole
    response, the tools' end) takes its parts from here instead of splitting again.

    `answer_end` (the tools' end, tools/end.py) reads the answer only, so a call written inside
    the think block never ends the reply. `reasoning_tokens` counts the tokens pushed while the
    reply had not left its think block (its markers included), once it had one.
    """

    splitter: ReasoningSplitter
    answer_end: TextMatcher | None = None  # reads the answer only; what it returns is not sent
    _thinking_tokens: int = field(default=0, init=False)
    _ended: bool = field(default=False, init=False)

    def push_token(self, text: str) -> tuple[Split, bool]:
        """One generated token's text (what the stop strings let through, maybe ""): its
        reasoning and answer parts, and whether the answer's end matched."""
        if self.splitter.thinking:
            self._thinking_tokens += 1
        return self.push(text)

    def push(self, text: str) -> tuple[Split, bool]:
        """Text that is no token's own (the detokenizer's and stop strings' held tail)."""
        split = self.splitter.push(text)
        return split, self._answer_ends(split.content)

    def finish(self) -> Split:
        """What the splitter held back, at the end of the reply (also when cut short)."""
        return self.splitter.finish()

    @property
    def reasoning_tokens(self) -> int:
        """Tokens of the think block, markers included: 0 for a reply without one."""
        return self._thinking_tokens if self.splitter.opened else 0

    def _answer_ends(self, answer: str) -> bool:
        if self._ended:
            return True
        if answer and self.answer_end is not None and self.answer_end.push(answer).matched:
            self._ended = True
        return self._ended


class MarkerText:
    """Pieces that write out the control tokens of a family's markers (gpt-oss's
    `<|channel|>`, `<|end|>`...), which text otherwise leaves out: the splitter must see
    them. Every other token reads as `base` has it."""

    __slots__ = ("_base", "_markers")

    def __init__(self, base: Pieces, vocab: Vocab, family: ReasoningFamily) -> None:
        self._base = base
        self._markers: dict[int, bytes] = {}
        for marker in (family.start, family.end, *family.content_prefixes):
            for token in vocab.tokenize(marker, add_special=False, parse_special=True):
                if token not in (vocab.bos_id, vocab.eos_id) and not vocab.piece(token):
                    self._markers[token] = vocab.text_of(token).encode()

    @classmethod
    def over(cls, base: Pieces, vocab: Vocab, family: ReasoningFamily | None) -> Pieces:
        """base, with the family's control-token markers written out when it has some."""
        if family is None:
            return base
        marked = cls(base, vocab, family)
        return marked if marked._markers else base

    @property
    def n_tokens(self) -> int:
        return self._base.n_tokens

    def piece(self, token_id: int) -> bytes:
        return self._markers.get(token_id) or self._base.piece(token_id)
