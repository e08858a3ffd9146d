"""One sequence's text from its generated tokens: detokenizing, stop strings, finish, usage.

Pure: no socket, no clock, no event loop. Generation feeds it what the worker sends, and
sends on what it gives back; a test can feed it by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...protocol.messages import (
    Finish,
    FinishReason,
    PromptLogprobs,
    TokenChunk,
    TokenLogprobs,
)
from ..api.response_bodies import Usage
from ..text.reasoning import ReplySplit
from ..text.stop import StopMatcher, TextMatcher
from ..text.tokenizer import IncrementalDetokenizer, Pieces
from ..workers.errors import WorkerBadOutput, WorkerFailed, WorkerLost


@dataclass(slots=True)
class TokenLogprob:
    """One token's log-probability and its top alternatives', with their bytes."""

    token: bytes
    logprob: float | None  # None only for a prompt's first token: nothing precedes it
    top: list[tuple[bytes, float]] | None  # most likely first; None with logprob None

    def scored(self) -> tuple[float, list[tuple[bytes, float]]]:
        """Its logprob and top alternatives, which every token but a prompt's first has."""
        if self.logprob is None or self.top is None:
            raise ValueError("a prompt's first token has no logprob")
        return self.logprob, self.top


@dataclass(slots=True)
class PromptScores:
    """The prompt's tokens and their logprobs (completions' echo with logprobs): the first
    event of such a sequence, before its text."""

    logprobs: list[TokenLogprob]


@dataclass(slots=True)
class TextDelta:
    """New text for the client, and the logprobs of the tokens it took when the request asked
    (never all empty: a token's text may still be held back while its logprob goes out).
    A chat reply whose thinking is split from its answer has its think block's text in
    `reasoning` (it comes before `text`, the answer's)."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning: str = ""


@dataclass(slots=True)
class Done:
    """The end of a sequence: OpenAI's finish reason, and the usage."""

    finish_reason: Literal["stop", "length"]
    usage: Usage


def finish_failure(finish: Finish) -> WorkerFailed | WorkerLost | None:
    """The error a Finish means for its client, or None when the request simply ended."""
    if finish.reason == FinishReason.ERROR:
        return WorkerFailed(finish.message, finish.code)
    if finish.reason == FinishReason.CANCELLED and finish.message:
        # The worker cancelled it on its own (shutting down, or it lost this gateway): the
        # text is cut short, which the client must not take for an ending.
        return WorkerLost(finish.message)
    return None


class TextAssembly:
    """Feed `take` the worker's chunks as they come, then call `done` once.

    Text that may be the start of a stop string is held back until it is known not to be;
    a matched stop string is dropped, and so is everything generated after it. With a
    ReplySplit, what the stop strings let through is split there, once, into thinking
    (`take_reasoning`) and answer (what push returns), and its tokens counted. The worker's
    output is not trusted: a chunk out of sequence or a token id outside the vocabulary
    raises WorkerBadOutput before any of it becomes text.
    """

    __slots__ = (
        "_detokenizer",
        "_matcher",
        "_n_vocab",
        "_prompt_logprobs",
        "_reasoning",
        "_split",
        "generated",
        "prompt_len",
        "received",
        "score_only",
        "scored_prompt",
        "stopped",
        "vocab",
    )

    def __init__(
        self,
        vocab: Pieces,
        stops: tuple[str, ...] | TextMatcher,  # stop strings, or what matches them and more
        prompt_len: int,
        scored_prompt: list[int] | None = None,
        score_only: bool = False,
        split: ReplySplit | None = None,  # a chat reply's thinking apart from its answer
    ) -> None:
        self.vocab = vocab
        self._split = split
        self._reasoning: list[str] = []  # thinking text not yet taken
        self._detokenizer = IncrementalDetokenizer(vocab)
        self._matcher = StopMatcher(stops) if isinstance(stops, tuple) else stops
        self._n_vocab = vocab.n_tokens
        self.prompt_len = prompt_len
        self.generated = 0  # tokens taken, up to and including the one that completed a stop
        self.received = 0  # tokens the worker sent, checked; the next chunk's seq
        self.stopped = False  # a stop string matched: the worker should be cancelled
        # The prompt's tokens when the worker scores them (PromptLogprobs); None otherwise.
        self.scored_prompt = scored_prompt
        self._prompt_logprobs: list[TokenLogprobs] = []  # for prompt tokens 1, 2, ...
        # max_tokens 0 with echo: the prompt is all the answer, and the one token the worker
        # must generate is dropped.
        self.score_only = score_only

    def take(self, chunk: TokenChunk) -> str:
        """Check a chunk against what came before, then push its tokens."""
        if chunk.seq != self.received:
            what = "repeated" if chunk.seq < self.received else "skipped"
            raise WorkerBadOutput(
                f"the worker {what} tokens: a chunk at position {chunk.seq}, "
                f"{self.received} tokens received"
            )
        bad = next((t for t in chunk.token_ids if not 0 <= t < self._n_vocab), None)
        if bad is not None:
            raise WorkerBadOutput(f"the worker sent token id {bad}, outside the vocabulary")
        self.received += len(chunk.token_ids)
        return self.push(chunk.token_ids)

    def push(self, token_ids: list[int]) -> str:
        """The text these tokens complete that is safe to send (the answer's only, with a
        split: see take_reasoning); "" once stopped."""
        if self.stopped or self.score_only:
            return ""
        parts: list[str] = []
        for token_id in token_ids:
            self.generated += 1
            match = self._matcher.push(self._detokenizer.push_one(token_id))
            text, matched = match.text, match.matched
            if self._split is not None:
                split, ended = self._split.push_token(text)
                self._reasoning.append(split.reasoning)
                text, matched = split.content, matched or ended
            parts.append(text)
            if matched:
                self.stopped = True
                break
        return "".join(parts)

    def take_reasoning(self) -> str:
        """The thinking text push and done made certain since the last call (with a split)."""
        text = "".join(self._reasoning)
        self._reasoning.clear()
        return text

    def logprobs(self, chunk: TokenChunk, taken: int) -> list[TokenLogprob]:
        """The logprobs of the first `taken` tokens of a chunk (those push took)."""
        if not chunk.logprobs:
            return []
        piece = self.vocab.piece
        return [
            TokenLogprob(
                piece(token),
                lp.logprob,
                [(piece(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)],
            )
            for token, lp in zip(chunk.token_ids[:taken], chunk.logprobs, strict=False)
        ]

    def push_prompt(self, scores: PromptLogprobs) -> None:
        """Keep the prompt logprobs of a chunk; positions already kept are not kept twice (a
        worker that evaluates the prompt again sends them again)."""
        skip = len(self._prompt_logprobs) + 1 - scores.first
        if skip >= 0:
            self._prompt_logprobs += scores.logprobs[skip:]

    def prompt_scores(self, final: bool = False) -> PromptScores | None:
        """The prompt's scores, once: when every prompt token has its logprobs (the worker
        sends them before the first generated token), or at the end with what came."""
        prompt = self.scored_prompt
        if prompt is None or (len(self._prompt_logprobs) < len(prompt) - 1 and not final):
            return None
        self.scored_prompt = None
        piece = self.vocab.piece
        entries = [TokenLogprob(piece(prompt[0]), None, None)]
        for token, lp in zip(prompt[1:], self._prompt_logprobs, strict=False):
            top = [(piece(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
            entries.append(TokenLogprob(piece(token), lp.logprob, top))
        return PromptScores(entries)

    def done(self, finish: Finish | None) -> tuple[str, Done]:
        """The last text (may be "") and the Done, given the worker's Finish.

        finish may be None only after a stop string, when the worker's Finish never came:
        the usage then counts what the gateway saw. Raises WorkerFailed for an engine error,
        WorkerLost when the worker cancelled the request on its own.
        """
        if self.stopped:
            return self._finish_split(""), Done("stop", self._usage(finish, self.generated))
        if finish is None:
            raise ValueError("a sequence that did not stop needs the worker's Finish")
        if finish.completion_tokens < self.received:
            raise WorkerBadOutput(
                f"the worker sent {self.received} tokens but finished the request "
                f"after {finish.completion_tokens}"
            )
        failure = finish_failure(finish)
        if failure is not None:
            raise failure
        if self.score_only:
            return "", Done("length", self._usage(finish, 0))
        match = self._matcher.push(self._detokenizer.flush())
        tail = match.text + ("" if match.matched else self._matcher.flush())
        if self._split is not None:
            split, _ = self._split.push(tail)
            self._reasoning.append(split.reasoning)
            tail = self._finish_split(split.content)
        # The worker's cancelled (by us or because it dropped this gateway) reads as stop.
        reason: Literal["stop", "length"] = (
            "length" if finish.reason == FinishReason.LENGTH else "stop"
        )
        return tail, Done(reason, self._usage(finish, finish.completion_tokens))

    def _finish_split(self, tail: str) -> str:
        """The answer's tail once the reply ended: what the split still held (a reply cut
        inside its think block ends there), its thinking kept for take_reasoning."""
        if self._split is None:
            return tail
        rest = self._split.finish()
        self._reasoning.append(rest.reasoning)
        return tail + rest.content

    def _usage(self, finish: Finish | None, completion_tokens: int) -> Usage:
        if finish is None:
            usage = Usage.of(self.prompt_len, completion_tokens, 0)
        else:
            usage = Usage.of(finish.prompt_tokens, completion_tokens, finish.cached_tokens)
        if self._split is None:
            return usage
        return usage.with_reasoning(self._split.reasoning_tokens)
