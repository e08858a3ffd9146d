"""One request's grammar, asked about one token at a time, and bounded in the work it does.

The sampler (sampling.py) checks the token its chain picked with `allows`, masks the whole
vocabulary with `mask` only when that token is refused, and advances the grammar with
`accept` only for the token it keeps: llama.cpp's own `common_sampler_sample`.

llama.cpp keeps one parse stack per way the text so far can be read. An ambiguous grammar
(`x ::= "a" x "b" | "a" x "c" | ""`) doubles them per character, and each accept costs about
the square of their number (measured: 12,288 stacks 0.09 s, 98,304 stacks 6 s, 196,608 stacks
54 s): one request's grammar could freeze the tick, and every stream with it. The number of
stacks is read from llama.cpp's grammar struct, whose layout (libstdc++ vectors behind the
grammar sampler's context) is checked once against grammars of known shape; a request whose
stacks would pass MAX_STACKS fails with GrammarTooComplex instead. Where the layout does not
check out, the bound is off (a warning says so) and the worker's watchdog is what is left.
The same read tells when the grammar is complete: when every stack is empty, nothing but an
end-of-generation token can follow.

A grammar can also be slow without being ambiguous: 500 alternatives to check against every
token of a 262k vocabulary cost seconds per mask, and four such requests held every stream
of the worker for half a minute, until its watchdog replaced it. So the time a grammar takes
is bounded too: TOKEN_BUDGET_S of grammar work (checks, masks, accepts) per token, measured
on the tick thread; a request over it fails at its next accept with GrammarTooComplex, and
the other requests go on. A mask that would surely break the budget (stacks x vocabulary x
SECONDS_PER_CHECK) is not done at all: the grammar then lets the sampler's token through, and
the accept that follows fails the request, as sampling.py handles it.
"""

from __future__ import annotations

import ctypes
import math
import os
import time
from dataclasses import dataclass, field

import llama_cpp as llama
import numpy as np
import structlog

log = structlog.get_logger(__name__)

MAX_STACKS = 1024  # parse stacks a request's grammar may keep; JSON schemas keep a few dozen
# Seconds of grammar work one token of one request may take on the tick thread. A JSON
# schema's mask over Gemma's 262k vocabulary took 110-150 ms on a loaded 2-core machine, a
# character-class grammar's 390 ms: room for a slower machine, and a bound on a tick.
TOKEN_BUDGET_S = 1.0
# A mask checks every token against every parse stack: at least this long per pair (measured
# 40 ns over Gemma's 262k vocabulary on a shared CPU; a floor below it, so that a mask is
# refused beforehand only when it would surely be slow). 500 alternatives: 500 stacks, 5.3 s
# a mask (2.1 s by this floor), refused before it starts; over that vocabulary a mask may
# start from up to 238 stacks (128 tools to choose from: 0.54 s by the floor).
SECONDS_PER_CHECK = 16e-9
# Growth is learnt from tokens that start with this many stacks or more: below, a token that
# opens a few alternatives says nothing about the grammar doubling per character.
GROWTH_FROM = 16
# Where llama.cpp keeps the grammar (src/llama-sampler.cpp, src/llama-grammar.h): the grammar
# sampler's context is {vocab*, std::string, std::string, llama_grammar*}, and llama_grammar
# starts {vocab*, rules (a vector), stacks (a vector of vectors of element pointers)}.
_GRAMMAR_IN_CONTEXT = 8 + 32 + 32
_STACKS_IN_GRAMMAR = 8 + 24
_VECTOR_BYTES = 24
_POINTER_BYTES = 8
_LAYOUT_CHECKS = (  # grammar -> the element count of each of its first stacks
    ('root ::= "a" | "b" | "c"', [1, 1, 1]),
    ('root ::= x "z"\nx ::= "a" | "b"', [2, 2]),
    ('root ::= "ab"', [1]),
)
# Tests only: the stack and time bounds off, so that a grammar can freeze a tick for real and the
# watchdog be tested on it (tests/test_grammar_faults.py). Never set it on a server.
UNBOUNDED_ENV = "LOOMSERVE_TEST_UNBOUNDED_GRAMMAR"
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class GrammarTooComplex(RuntimeError):
    """The request's grammar would keep more parse stacks than MAX_STACKS, or took more than
    TOKEN_BUDGET_S for one token."""


class Candidates:
    """A llama_token_data_array over the whole vocabulary, filled from a row of logits.

    One per vocabulary, shared by the samplers of one tick loop (they run one at a time).
    """

    __slots__ = ("_buffer", "_ids", "array", "pointer")

    def __init__(self, n_vocab: int) -> None:
        self._buffer = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.array = llama.llama_token_data_array()
        self.pointer = ctypes.pointer(self.array)

    def fill(self, logits: np.ndarray) -> None:
        """Every token with its logit, unsorted and none selected, as llama_sampler_sample
        builds them."""
        buffer = self._buffer
        buffer["id"] = self._ids  # again each time: samplers sort the entries in place
        buffer["logit"] = logits
        buffer["p"] = 0.0
        array = self.array
        # llama_cpp annotates `data` as an array; the C field is a pointer, which this is.
        pointer = buffer.ctypes.data_as(ctypes.POINTER(llama.llama_token_data))
        array.data = pointer  # type: ignore[assignment]
        array.size = len(buffer)
        array.selected = -1
        array.sorted = False

    def selected(self) -> int:
        """The token the chain's last stage selected."""
        return int(self._buffer["id"][self.array.selected])

    def logits(self) -> np.ndarray:
        """The entries' logits as the samplers left them (a view; in id order unless a stage
        sorted them: logit bias, penalties and greedy do not)."""
        return self._buffer["logit"][: self.array.size]

    def first_maximum(self) -> int:
        """The greedy choice over the entries as they are, which must still be in id order
        (a grammar mask leaves them so): llama.cpp's greedy sampler picks the first maximum."""
        return int(self._buffer["logit"][: self.array.size].argmax())

    def surviving(self) -> np.ndarray:
        """The ids whose logit is not -inf."""
        entries = self._buffer[: self.array.size]
        return entries["id"][entries["logit"] != -np.inf]


@dataclass(slots=True)
class GrammarVocab:
    """What every grammar over one vocabulary shares: the candidates buffer, an end token,
    the length of each token's text, and whether the stack layout checked out."""

    vocab: object
    n_vocab: int
    candidates: Candidates
    eog_token: int
    stacks_readable: bool
    bounded: bool  # whether MAX_STACKS is enforced: the stacks are readable, and no test said
    _piece_bytes: dict[int, int] = field(default_factory=dict)
    _piece_buffer: ctypes.Array = field(default_factory=lambda: ctypes.create_string_buffer(256))

    def piece_bytes(self, token: int) -> int:
        """The bytes of the token's text as the grammar reads it (special tokens written out):
        an upper bound on the characters it advances the grammar by."""
        n = self._piece_bytes.get(token)
        if n is None:
            buffer = self._piece_buffer
            n = llama.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, True)
            n = self._piece_bytes[token] = abs(n) or 1
        return n


_VOCABS: dict[tuple[int, int, int], GrammarVocab] = {}


def grammar_vocab(vocab, n_vocab: int) -> GrammarVocab:
    """The shared state for this vocabulary, made on its first grammar."""
    eog = llama.llama_vocab_eos(vocab)
    if eog < 0:
        eog = llama.llama_vocab_eot(vocab)
    # The end token in the key too: a model loaded where a freed one was is another entry.
    key = (ctypes.cast(vocab, ctypes.c_void_p).value or 0, n_vocab, eog)
    shared = _VOCABS.get(key)
    if shared is None:
        readable = _layout_checks_out(vocab)
        if not readable:
            log.warning(
                "cannot read llama.cpp's grammar stacks in this build: grammar work is bounded "
                "only by the tick watchdog"
            )
        bounded = readable and not os.environ.get(UNBOUNDED_ENV)
        shared = _VOCABS[key] = GrammarVocab(
            vocab, n_vocab, Candidates(n_vocab), eog, readable, bounded
        )
    return shared


def _stacks(sampler) -> tuple[int, int]:
    """Where the grammar's vector of parse stacks begins, and how many it holds."""
    context = sampler.contents.ctx
    grammar = ctypes.c_void_p.from_address(context + _GRAMMAR_IN_CONTEXT).value
    if not grammar:
        return 0, 0
    begin = ctypes.c_void_p.from_address(grammar + _STACKS_IN_GRAMMAR).value or 0
    end = ctypes.c_void_p.from_address(grammar + _STACKS_IN_GRAMMAR + _POINTER_BYTES).value or 0
    return begin, (end - begin) // _VECTOR_BYTES


def _stack_sizes(sampler, limit: int) -> list[int]:
    """The element count of each of the grammar's first `limit` parse stacks."""
    begin, count = _stacks(sampler)
    sizes = []
    for i in range(min(count, limit)):
        first = begin + i * _VECTOR_BYTES
        stack_begin = ctypes.c_void_p.from_address(first).value or 0
        stack_end = ctypes.c_void_p.from_address(first + _POINTER_BYTES).value or 0
        sizes.append((stack_end - stack_begin) // _POINTER_BYTES)
    return sizes


def _layout_checks_out(vocab) -> bool:
    """Whether the stacks read as expected from grammars whose stacks are known."""
    for text, expected in _LAYOUT_CHECKS:
        sampler = llama.llama_sampler_init_grammar(vocab, text.encode(), b"root")
        if not sampler:
            return False
        try:
            if llama.llama_sampler_name(sampler) != b"grammar":
                return False
            if _stack_sizes(sampler, 8) != expected:
                return False
        finally:
            llama.llama_sampler_free(sampler)
    return True


class GrammarState:
    """One request's grammar sampler (owned: freed by close) and the bound on its stacks."""

    __slots__ = (
        "_growth",
        "_one",
        "_one_pointer",
        "_refused",
        "_spent",
        "budget",
        "sampler",
        "shared",
    )

    def __init__(self, sampler, shared: GrammarVocab) -> None:
        self.sampler = sampler
        self.shared = shared
        self._one = llama.llama_token_data_array()
        self._one.data = (llama.llama_token_data * 1)()
        self._one_pointer = ctypes.pointer(self._one)
        self._growth = 1.0  # the most the stacks have multiplied per byte of a token (from 16)
        self._spent = 0.0  # seconds of grammar work on the token being sampled
        self._refused = 0.0  # the predicted seconds of a mask not done (over the budget)
        # The test switch that lets a grammar freeze a tick lifts the time bound too.
        self.budget = math.inf if os.environ.get(UNBOUNDED_ENV) else TOKEN_BUDGET_S

    def allows(self, token: int) -> bool:
        """Whether the grammar lets this token come next (one candidate, not the vocabulary).

        After a mask refused for its cost, any token: the accept that follows fails."""
        if self._refused:
            return True
        started = time.perf_counter()
        one = self._one
        one.data[0] = llama.llama_token_data(token, 1.0, 0.0)
        one.size, one.selected, one.sorted = 1, -1, False
        llama.llama_sampler_apply(self.sampler, self._one_pointer)
        self._spent += time.perf_counter() - started
        return one.data[0].logit != -math.inf

    def mask(self, candidates: Candidates) -> None:
        """Set every token the grammar refuses to -inf; or, when that would surely take more
        than the token's budget, nothing (the next accept fails the request)."""
        if self.shared.bounded:
            stacks = _stacks(self.sampler)[1]
            predicted = stacks * candidates.array.size * SECONDS_PER_CHECK
            if self._spent + predicted > self.budget:
                self._refused = predicted
                return
        started = time.perf_counter()
        llama.llama_sampler_apply(self.sampler, candidates.pointer)
        self._spent += time.perf_counter() - started

    def accept(self, token: int) -> None:
        """Advance the grammar by a token it allows; GrammarTooComplex when the token would,
        by the growth seen so far, or did take it past MAX_STACKS, or when the grammar's work
        on this token took more than its time budget."""
        spent, self._spent = self._spent + self._refused, 0.0
        estimated, self._refused = bool(self._refused), 0.0
        if spent > self.budget:
            raise GrammarTooComplex(self._too_slow(spent, estimated))
        started = time.perf_counter()
        self._accept(token)
        spent += time.perf_counter() - started
        if spent > self.budget:
            raise GrammarTooComplex(self._too_slow(spent))

    def _accept(self, token: int) -> None:
        if not self.shared.bounded:
            llama.llama_sampler_accept(self.sampler, token)
            return
        before = _stacks(self.sampler)[1]
        length = self.shared.piece_bytes(token)
        if before * self._growth**length > MAX_STACKS:
            raise GrammarTooComplex(self._too_complex(math.ceil(before * self._growth**length)))
        llama.llama_sampler_accept(self.sampler, token)
        after = _stacks(self.sampler)[1]
        if after > MAX_STACKS:
            raise GrammarTooComplex(self._too_complex(after))
        if after > before >= GROWTH_FROM:
            self._growth = max(self._growth, (after / before) ** (1 / length))

    def _too_slow(self, spent: float, estimated: bool = False) -> str:
        took = "would take at least" if estimated else "took"
        return (
            f"the grammar is too slow: checking one token against it {took} "
            f"{spent * 1000:.0f} ms of the worker's time, more than the "
            f"{self.budget * 1000:.0f} ms allowed; use a grammar with fewer alternatives "
            "(or fewer tools)"
        )

    @staticmethod
    def _too_complex(stacks: int) -> str:
        return (
            f"the grammar is too ambiguous: parsing the output so far takes {stacks} parse "
            f"stacks, more than the {MAX_STACKS} allowed"
        )

    def complete(self) -> bool:
        """Whether nothing but an end-of-generation token can follow."""
        if self.shared.stacks_readable:
            # Stacks are never duplicated, so an empty one is alone or has company.
            return _stacks(self.sampler)[1] == 1 and _stack_sizes(self.sampler, 1) == [0]
        # Without the stacks: an end token is allowed, and no other token of the vocabulary.
        if not self.allows(self.shared.eog_token):
            return False
        candidates = self.shared.candidates
        candidates.fill(np.zeros(self.shared.n_vocab, dtype=np.float32))
        self.mask(candidates)
        vocab = self.shared.vocab
        return all(llama.llama_vocab_is_eog(vocab, int(t)) for t in candidates.surviving())

    def close(self) -> None:
        if self.sampler:
            llama.llama_sampler_free(self.sampler)
            self.sampler = None
