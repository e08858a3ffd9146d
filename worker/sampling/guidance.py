"""One request's grammar on llguidance: asked about one token, or masking the vocabulary.

llguidance (the grammar engine of vLLM, SGLang and llama.cpp's optional backend) keeps a
lexer and an Earley parser over a trie of the model's tokens: the whole next-token mask
costs about 0.1 ms over Gemma's 262,144 tokens, and each step's work is capped by the
parser limits the request was compiled with (protocol/limits.py, GRAMMAR_LIMITS): lexer
fuel and Earley items per step, lexer states, grammar size. A grammar that needs more fails
its own request with llguidance's message, before the work, and nothing else on the worker
notices. No wall clock is involved: a slow machine is never a reason to refuse a grammar.

The sampler (samplers.py) checks the token it drew with `allows` (a bit of the step's mask),
draws again from the `allowed` tokens only when that token is refused, and advances the
grammar with `accept` for the token it keeps: llama.cpp's `common_sampler_sample`.

The tokenizer llguidance needs (each token's bytes) is built once per model, on a thread of
its own while the worker starts (2.8 s for Gemma's vocabulary, 5 ms for the test model's).
Each token is its text with control tokens written out, as llama.cpp's grammar sampler reads
them, so a grammar's literal `<think>` or `<|call|>` matches the model's single token as well
as the text spelled out; end-of-generation tokens are not text: they end the output, allowed
only where the grammar may end.
"""

from __future__ import annotations

import ctypes
import threading

import llama_cpp as llama
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from ...protocol.limits import guidance_grammar_problem, parser_limits

_SPECIAL = b"\xff"  # llguidance's mark of a token that is not text


class GrammarFailed(RuntimeError):
    """The request's grammar cannot go on: a step over its limits, or a token it refuses."""


class GrammarVocab:
    """What every grammar over one model's vocabulary shares: llguidance's tokenizer, built
    on a thread from construction on."""

    def __init__(self, vocab, n_vocab: int) -> None:
        self.vocab = vocab
        self.n_vocab = n_vocab
        self._tokenizer: LLTokenizer | None = None
        self.ends: frozenset[int] = frozenset()  # the end-of-generation tokens
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._build, name="grammar-tokenizer", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            self._tokenizer = llguidance_tokenizer(self.vocab, self.n_vocab)
            self.ends = frozenset(
                t for t in range(self.n_vocab) if llama.llama_vocab_is_eog(self.vocab, t)
            )
        except BaseException as exc:  # said when the first grammar needs it
            self._failure = exc

    @property
    def tokenizer(self) -> LLTokenizer:
        """The tokenizer, waiting for its build when a grammar comes that early."""
        self._thread.join()
        if self._tokenizer is None:
            raise RuntimeError(f"llguidance's tokenizer could not be built: {self._failure}")
        return self._tokenizer

    def close(self) -> None:
        """Wait for the build: it reads the vocabulary, which the engine frees next."""
        self._thread.join()


def llguidance_tokenizer(vocab, n_vocab: int) -> LLTokenizer:
    """llguidance's view of the vocabulary: each token's text with control tokens written
    out, end-of-generation tokens marked as not text (see the module's docstring)."""
    buffer = ctypes.create_string_buffer(16 * 1024)
    tokens: list[bytes] = []
    ends: list[int] = []
    for token in range(n_vocab):
        n = llama.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, True)
        piece = buffer.raw[: max(n, 0)]
        if llama.llama_vocab_is_eog(vocab, token):
            ends.append(token)
            piece = _SPECIAL + piece
        tokens.append(piece)
    if not ends:
        raise ValueError("the vocabulary has no end-of-generation token")
    tokenize = ctypes.cast(llama.llama_cpp._lib.llama_tokenize, ctypes.c_void_p).value
    return LLTokenizer.from_llamacpp(  # type: ignore[attr-defined]
        tokens=tokens, vocab_ptr=vocab, tokenize_fptr=tokenize, eos_token=ends, slices=None
    )


def request_grammar(text: str, shared: GrammarVocab | None) -> GrammarState:
    """A request's grammar, bounded first: ValueError naming why it cannot be used (too
    large to read, a worker without grammars, or it does not compile within its limits),
    before anything else is allocated."""
    problem = guidance_grammar_problem(text)
    if problem:
        raise ValueError(problem)
    if shared is None:
        raise ValueError("this worker takes no grammars")
    return compile_grammar(text, shared)


def compile_grammar(grammar: str, shared: GrammarVocab) -> GrammarState:
    """The request's grammar (llguidance's Lark or JSON form) compiled for this vocabulary;
    ValueError with llguidance's message when it does not compile within the limits."""
    matcher = LLMatcher(shared.tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise ValueError(f"the grammar cannot be used: {matcher.get_error()}")
    return GrammarState(matcher, shared)


class GrammarState:
    """One request's llguidance matcher, advanced token by token.

    Whether a token is allowed is read from the step's mask, computed once per step (about
    0.1 ms over 262,144 tokens): llguidance's one-token check (validate_tokens) also lets
    through a token whose text duplicates one the mask keeps (a byte token beside the
    same character's own), so checking one way and masking the other could pick otherwise
    than masking first.
    """

    __slots__ = ("_bits", "_masked", "matcher", "shared")

    def __init__(self, matcher: LLMatcher, shared: GrammarVocab) -> None:
        self.matcher = matcher
        self.shared = shared
        # Its own (32 KB at 262,144 tokens): the first step's may be computed on another
        # thread (GrammarCompiler) while the tick samples other requests' grammars.
        self._bits = np.zeros((shared.n_vocab + 31) // 32, dtype=np.int32)
        self._masked = False  # whether _bits holds this step's mask

    def allows(self, token: int) -> bool:
        """Whether the grammar lets this token come next; GrammarFailed when the step is
        over the grammar's limits."""
        bits = self._mask_bits()
        return bool((int(bits[token >> 5]) >> (token & 31)) & 1)

    def allowed(self) -> np.ndarray:
        """The ids of every token the grammar lets come next, ascending; GrammarFailed when
        the step is over the grammar's limits."""
        bits = self._mask_bits()
        allowed = np.unpackbits(bits.view(np.uint8), count=self.shared.n_vocab, bitorder="little")
        return np.flatnonzero(allowed)

    def prime(self) -> None:
        """Compute the next step's mask now (the first step's, before the request is queued);
        GrammarFailed when that step is over the grammar's limits."""
        self._mask_bits()

    def _mask_bits(self) -> np.ndarray:
        """This step's mask: a bit per token, set where the grammar allows it; computed once
        a step (llguidance lets go of the GIL meanwhile)."""
        bits = self._bits
        if not self._masked:
            self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            self._check()
            self._masked = True
        return bits

    def accept(self, token: int) -> None:
        """Advance the grammar by a token it allows; GrammarFailed when it cannot.

        An end-of-generation token (allowed where the grammar may end) leaves the grammar as
        it is, as llama.cpp's grammar does: it ends the request, unless the request ignores
        EOS, and then the grammar goes on from where it was."""
        if token in self.shared.ends:
            return
        self._masked = False
        if not self.matcher.consume_token(token):
            self._check()
            raise GrammarFailed(f"the grammar refused token {token}")

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarFailed(f"the grammar cannot go on: {self.matcher.get_error()}")

    def complete(self) -> bool:
        """Whether nothing but an end-of-generation token can follow."""
        return self.matcher.is_stopped()

    def close(self) -> None:
        """Nothing native to free by hand: the matcher goes with its last reference."""
