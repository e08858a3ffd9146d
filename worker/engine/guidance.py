"""One request's grammar on llguidance: asked about one token, or masking the vocabulary.

llguidance (the grammar engine of vLLM, SGLang and llama.cpp's optional backend) keeps a
lexer and an Earley parser over a trie of the model's tokens: the whole next-token mask
costs about 0.1 ms over Gemma's 262,144 tokens, and each step's work is capped by the
parser limits the request was compiled with (protocol/limits.py, GRAMMAR_LIMITS): lexer
fuel and Earley items per step, lexer states, grammar size. A grammar that needs more fails
its own request with llguidance's message, before the work, and nothing else on the worker
notices. No wall clock is involved: a slow machine is never a reason to refuse a grammar.

The sampler (sampling.py) checks the token its chain picked with `allows` (a bit of the
step's mask), masks the row with `mask` only when that token is refused, and advances the
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

from loomserve.protocol.limits import parser_limits

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
_SPECIAL = b"\xff"  # llguidance's mark of a token that is not text


class GrammarFailed(RuntimeError):
    """The request's grammar cannot go on: a step over its limits, or a token it refuses."""


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


class GrammarVocab:
    """What every grammar over one model's vocabulary shares: llguidance's tokenizer (built
    on a thread from construction on), the candidates buffer and the mask's bits."""

    def __init__(self, vocab, n_vocab: int) -> None:
        self.vocab = vocab
        self.n_vocab = n_vocab
        self.candidates = Candidates(n_vocab)
        self.bitmask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self.masked_by: GrammarState | None = None  # whose step the bitmask holds
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

    __slots__ = ("_masked", "matcher", "shared")

    def __init__(self, matcher: LLMatcher, shared: GrammarVocab) -> None:
        self.matcher = matcher
        self.shared = shared
        self._masked = False  # whether shared.bitmask holds this step's mask

    def allows(self, token: int) -> bool:
        """Whether the grammar lets this token come next; GrammarFailed when the step is
        over the grammar's limits."""
        bits = self._mask_bits()
        return bool((int(bits[token >> 5]) >> (token & 31)) & 1)

    def mask(self, candidates: Candidates) -> None:
        """Set every token the grammar refuses to -inf (the entries must be in id order);
        GrammarFailed when the step is over the grammar's limits."""
        bits = self._mask_bits()
        allowed = np.unpackbits(bits.view(np.uint8), count=self.shared.n_vocab, bitorder="little")
        np.putmask(candidates.logits(), ~allowed.view(bool), -np.inf)

    def _mask_bits(self) -> np.ndarray:
        """This step's mask: a bit per token, set where the grammar allows it. The buffer is
        shared by the tick's samplers, which sample one at a time: another request's step
        since means this one's is computed again."""
        bits = self.shared.bitmask
        if not self._masked or self.shared.masked_by is not self:
            self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            self._check()
            self._masked = True
            self.shared.masked_by = self
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
        if self.shared.masked_by is self:
            self.shared.masked_by = None
