"""The engine's batch: one reusable llama_batch over numpy buffers (TokenBatch), and a step's
runs written into it, each the way its logits are read back (fill_batch)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import llama_cpp as llama
import numpy as np

from ..sched.media import rope_position
from ..sched.slots import Run, Slot, Step
from .token_rows import TokenRows


class TokenBatch:
    """One reusable llama_batch whose arrays are numpy buffers we own."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        self._n_seq_id = np.ones(capacity, dtype=np.int32)
        # Every token belongs to exactly one sequence: seq_id[i] points at self.seq[i].
        int32_p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (int32_p * capacity)(
            *(ctypes.cast(base + 4 * i, int32_p) for i in range(capacity))
        )
        self.struct = llama.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(int32_p),
            embd=None,
            pos=self.pos.ctypes.data_as(int32_p),
            n_seq_id=self._n_seq_id.ctypes.data_as(int32_p),
            seq_id=self._seq_ptrs,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )
        self.n_tokens = 0
        # The same rows as embeddings (carry_embeddings): a pass with an image's rows.
        self.embd: np.ndarray | None = None
        self.embd_struct: llama.llama_batch | None = None
        self.embedded = False  # this pass goes in as embeddings (embed_rows)

    def carry_embeddings(self, n_embd: int) -> None:
        """Make room for the batch's rows as embeddings: a second llama_batch over the same
        positions, sequences and logits flags, with rows of n_embd floats for tokens."""
        int32_p = ctypes.POINTER(ctypes.c_int32)
        self.embd = np.zeros((self.capacity, n_embd), dtype=np.float32)
        self.embd_struct = llama.llama_batch(
            n_tokens=0,
            token=None,
            embd=self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            pos=self.pos.ctypes.data_as(int32_p),
            n_seq_id=self._n_seq_id.ctypes.data_as(int32_p),
            seq_id=self._seq_ptrs,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    @property
    def active(self) -> llama.llama_batch:
        """The llama_batch the next pass decodes: of tokens, or of the same rows embedded."""
        struct = self.embd_struct if self.embedded else self.struct
        assert struct is not None
        struct.n_tokens = self.n_tokens
        return struct

    def clear(self) -> None:
        self.n_tokens = 0
        self.embedded = False

    def add(self, token: int, pos: int, seq: int, want_logits: bool) -> int:
        """Append one token; return its index in the batch."""
        i = self.n_tokens
        self.token[i] = token
        self.pos[i] = pos
        self.seq[i] = seq
        self.logits[i] = want_logits
        self.n_tokens = i + 1
        return i

    def add_run(
        self,
        tokens: list[int],
        first_pos: int,
        seq: int,
        logits_on_last: bool,
        logits_on_all: bool = False,
    ) -> int:
        """Append consecutive tokens of one sequence; return the index of the last one."""
        i, j = self.n_tokens, self.n_tokens + len(tokens)
        self.token[i:j] = tokens
        self.pos[i:j] = np.arange(first_pos, first_pos + len(tokens), dtype=np.int32)
        self.seq[i:j] = seq
        self.logits[i:j] = logits_on_all
        self.logits[j - 1] = logits_on_last or logits_on_all
        self.n_tokens = j
        return j - 1

    def add_verified_run(self, tokens: list[int], first_pos: int, seq: int, n_logits: int) -> int:
        """Append consecutive tokens of one sequence with logits on the first n_logits of
        them (a token and its drafts; filler after them); return the first one's index."""
        first = self.n_tokens
        self.add_run(tokens, first_pos, seq, False)
        self.logits[first : first + n_logits] = 1
        return first


@dataclass(slots=True)
class Filled:
    """What the batch holds beyond its tokens: who samples where, and the runs read their own
    way (drafts to verify, a prompt to score)."""

    sampled: list[tuple[Slot, int]] = field(default_factory=list)  # batch indices, batch order
    verified: dict[int, Run] = field(default_factory=dict)  # decode runs with extra tokens
    scoring: Step | None = None  # the step, when a run scores its prompt


def fill_batch(batch: TokenBatch, step: Step) -> Filled:
    """Fill the engine's batch from the runs, in their order; the slots to sample and their
    batch indices come back in batch order (the order of the output logits' rows)."""
    batch.clear()
    filled = Filled()
    for run in step.runs:
        seq = run.slot.index
        # After an M-RoPE image a token's rope position is less than its prompt index.
        media = run.slot.request.media if run.slot.request is not None else ()
        start = rope_position(media, run.start) if media else run.start
        if run.filler and run.pad:  # padding grown to the tick's draft length
            last = batch.add_run(run.tokens, start, seq, False)
        elif run.draft or run.filler:  # its token, its drafts (logits on each), filler
            last = batch.add_verified_run(run.tokens, start, seq, 1 + run.draft)
            filled.verified[seq] = run
        elif run.score:  # a prompt being scored: logits on every token (logprobs.py)
            last = batch.add_run(run.tokens, start, seq, True, logits_on_all=True)
            filled.scoring = step
        elif len(run.tokens) == 1:  # a decode token: the cheaper single add
            last = batch.add(run.tokens[0], start, seq, run.sample)
        else:
            last = batch.add_run(run.tokens, start, seq, run.sample)
        if run.sample:
            filled.sampled.append((run.slot, last))
    return filled


def holds_image_rows(step: Step) -> bool:
    """Whether a run of the step takes an image's positions (their placeholders are below
    zero, sched/media.py): the pass must then go in as embeddings."""
    return any(run.tokens and min(run.tokens) < 0 for run in step.runs if not run.pad)


def embed_rows(batch: TokenBatch, step: Step, token_rows: TokenRows) -> tuple[int, int]:
    """Write the filled batch's rows as embeddings (carry_embeddings): a token as its input
    row, an image's position as its embedding; the next pass decodes them (`active`).
    Return the image rows, and the images whose last rows are among them."""
    assert batch.embd is not None
    n = batch.n_tokens
    tokens = batch.token[:n]
    text = np.flatnonzero(tokens >= 0)
    batch.embd[text] = token_rows.rows(tokens[text])
    placed = completed = first = 0
    for run in step.runs:  # fill_batch put each run's tokens next, in step order
        end = run.start + len(run.tokens)
        media = run.slot.request.media if run.slot.request is not None and not run.pad else ()
        for span in media:
            lo, hi = max(run.start, span.start), min(end, span.end)
            if lo < hi:
                at = first + lo - run.start
                batch.embd[at : at + hi - lo] = span.embeddings[lo - span.start : hi - span.start]
                placed += hi - lo
                completed += hi == span.end
        first += len(run.tokens)
    if placed != n - len(text):
        raise RuntimeError("a placeholder outside its request's images")
    batch.embedded = True
    return placed, completed
