"""Embeddings: a second llama.cpp context over the worker's model, with embeddings on.

Why a second context and not sequences of the generation context: llama_set_embeddings
switches a whole context, pooling needs every token of a sequence in one micro-batch, and the
generation context's slots, KV streams and batch-invariant kernels stay exactly as they were.
The context shares the model's weights; its own KV cache holds one batch of inputs and is
cleared after each.

The tick loop calls `run()` once per tick while inputs wait: it takes whole inputs, oldest
first, up to `max_tokens` tokens and `MAX_SEQUENCES` inputs, and returns the Embeddings of
every request whose inputs are all done. An input longer than one batch is refused when it
arrives.

With batch invariance (the worker's default) each input gets a llama_decode of its own, so its
vector is bit-equal to the one it gets alone, whatever else the request or the tick holds: in
one decode the attention over the shared cache sums in an order that follows the batch's shape,
which moved components by up to 5e-5 on the test model. Without it the inputs share one decode.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import llama_cpp as llama
import numpy as np
import structlog

from ...protocol import Embed, Embeddings, ErrorCode, Rejected
from ..config import WorkerConfig
from .engine import Engine, TokenBatch

log = structlog.get_logger(__name__)

MAX_SEQUENCES = 32  # inputs per llama_decode
MAX_PENDING_INPUTS = 4096  # inputs waiting; more are refused as queue_full
RANK = llama.LLAMA_POOLING_TYPE_RANK  # a reranker's classifier head
POOLING_NAMES = {
    llama.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama.LLAMA_POOLING_TYPE_CLS: "cls",
    llama.LLAMA_POOLING_TYPE_LAST: "last",
    RANK: "rank",
}


Reply = Embeddings | Rejected


@dataclass(slots=True)
class _Job:
    """One Embed on its way: its inputs, and the vectors done so far."""

    gateway: bytes
    embed: Embed
    vectors: list[np.ndarray | None] = field(default_factory=list)
    next_input: int = 0  # inputs before this one are in a batch already
    offered_at: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return all(v is not None for v in self.vectors)

    def matrix(self) -> np.ndarray:
        """Its vectors, one row per input, once it is done."""
        rows = [v for v in self.vectors if v is not None]
        if len(rows) != len(self.vectors):
            raise RuntimeError(f"embedding {self.embed.request_id!r} is not done")
        return np.stack(rows)


def model_pooling(engine: Engine) -> int:
    """The pooling the model's own metadata declares (a pooling head); NONE when it has none."""
    key = f"{engine.description.architecture}.pooling_type".encode()
    buffer = ctypes.create_string_buffer(32)
    n = llama.llama_model_meta_val_str(engine.model, key, buffer, len(buffer))
    if n < 0:
        return llama.LLAMA_POOLING_TYPE_NONE
    try:
        return int(buffer.value)
    except ValueError:
        return llama.LLAMA_POOLING_TYPE_NONE


class Embedder:
    """The embedding context and the inputs waiting for it."""

    def __init__(self, engine: Engine, config: WorkerConfig, pooling: int) -> None:
        self.max_tokens = min(engine.slot_context, config.batch_tokens)
        self.pooling = pooling
        # What llama.cpp writes a sequence: a pooled vector of the model's width, or for a
        # reranker (rank pooling) its classifier's scores, n_cls_out floats (1 or 2), which
        # are served as they are (scores, not directions: never normalized).
        self.scores = pooling == RANK
        self.size = (
            llama.llama_model_n_cls_out(engine.model)
            if self.scores
            else llama.llama_model_n_embd(engine.model)
        )
        params = llama.llama_context_default_params()
        params.embeddings = True
        params.pooling_type = pooling
        params.n_ctx = params.n_batch = params.n_ubatch = self.max_tokens
        params.n_seq_max = MAX_SEQUENCES
        params.n_threads = params.n_threads_batch = config.n_threads
        params.no_perf = True
        if "kv_unified" in {entry[0] for entry in llama.llama_context_params._fields_}:
            params.kv_unified = True  # inputs of any length share the one batch's cells
        self.ctx = llama.llama_init_from_model(engine.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the embedding context")
        self.memory = llama.llama_get_memory(self.ctx)
        self.batch = TokenBatch(self.max_tokens)
        self.n_vocab = engine.n_vocab
        self.one_input_per_decode = config.batch_invariant
        self._jobs: deque[_Job] = deque()
        self._pending_inputs = 0
        # Told of each Embed answered (the Embed, when it was offered, now, why it failed or
        # ""): the worker's tracer, when tracing is on (tick/tracing.py).
        self.on_done: Callable[[Embed, float, float, str], None] | None = None

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def offer(self, gateway: bytes, embed: Embed) -> Rejected | None:
        """Queue an Embed; a Rejected when it cannot be taken."""
        for tokens in embed.inputs:
            if len(tokens) > self.max_tokens:
                return Rejected(
                    embed.request_id,
                    ErrorCode.PROMPT_TOO_LONG.value,
                    f"an input has {len(tokens)} tokens; embeddings take at most {self.max_tokens}",
                )
            if max(tokens) >= self.n_vocab:
                return Rejected(
                    embed.request_id,
                    ErrorCode.INVALID_REQUEST.value,
                    f"token ids must be below {self.n_vocab}",
                )
        if self._pending_inputs + len(embed.inputs) > MAX_PENDING_INPUTS:
            return Rejected(
                embed.request_id,
                ErrorCode.QUEUE_FULL.value,
                f"{self._pending_inputs} embedding inputs are waiting",
            )
        self._jobs.append(_Job(gateway, embed, [None] * len(embed.inputs)))
        self._pending_inputs += len(embed.inputs)
        return None

    def cancel(self, gateway: bytes, request_id: str | None = None) -> None:
        """Forget a gateway's Embed (all of them when request_id is None)."""
        kept: deque[_Job] = deque()
        for job in self._jobs:
            if job.gateway == gateway and request_id in (None, job.embed.request_id):
                self._pending_inputs -= len(job.embed.inputs) - job.next_input
            else:
                kept.append(job)
        self._jobs = kept

    def run(self) -> list[tuple[bytes, Reply]]:
        """Embed the oldest waiting inputs, one tick's worth; the requests this completed."""
        taken = self._take_inputs()
        self._pending_inputs -= len(taken)
        groups = [[item] for item in taken] if self.one_input_per_decode else [taken]
        for group in groups:
            code = self._decode(group)
            if code != 0:
                log.error("embedding decode failed", code=code, inputs=len(group))
                failed = [job for job, _ in taken]
                return self._fail(failed, f"llama_decode failed with code {code}")
        return self._take_done()

    def _take_inputs(self) -> list[tuple[_Job, int]]:
        """Whole inputs, oldest first, within one batch's tokens and sequences."""
        taken: list[tuple[_Job, int]] = []
        n_tokens = 0
        for job in self._jobs:
            while job.next_input < len(job.embed.inputs) and len(taken) < MAX_SEQUENCES:
                tokens = job.embed.inputs[job.next_input]
                if n_tokens + len(tokens) > self.max_tokens:
                    break
                n_tokens += len(tokens)
                taken.append((job, job.next_input))
                job.next_input += 1
            if job.next_input < len(job.embed.inputs):
                break  # inputs stay in order: a later job waits for this one
        return taken

    def _decode(self, group: list[tuple[_Job, int]]) -> int:
        """One llama_decode over these inputs, a sequence each; their vectors set on success."""
        batch = self.batch
        batch.clear()
        for seq, (job, index) in enumerate(group):
            start = batch.n_tokens
            batch.add_run(job.embed.inputs[index], 0, seq, True)
            batch.logits[start : batch.n_tokens] = 1  # pooling reads every token
        llama.llama_memory_clear(self.memory, True)
        batch.struct.n_tokens = batch.n_tokens
        code = llama.llama_decode(self.ctx, batch.struct)
        if code != 0:
            return code
        for seq, (job, index) in enumerate(group):
            pointer = llama.llama_get_embeddings_seq(self.ctx, seq)
            if not pointer:  # llama.cpp pooled nothing for it: never read a NULL
                return -1
            # Exactly the floats llama.cpp wrote for the sequence (self.size), copied.
            vector = np.ctypeslib.as_array(pointer, shape=(self.size,)).astype(np.float32)
            norm = float(np.linalg.norm(vector))
            if not self.scores and norm > 0:
                vector = vector / norm
            job.vectors[index] = vector
        return 0

    def _take_done(self) -> list[tuple[bytes, Reply]]:
        replies: list[tuple[bytes, Reply]] = []
        while self._jobs and self._jobs[0].done:
            job = self._jobs.popleft()
            data = job.matrix().astype("<f4").tobytes()
            tokens = sum(len(t) for t in job.embed.inputs)
            replies.append((job.gateway, Embeddings(job.embed.request_id, self.size, data, tokens)))
            if self.on_done is not None:
                self.on_done(job.embed, job.offered_at, time.monotonic(), "")
        return replies

    def _fail(self, jobs: list[_Job], message: str) -> list[tuple[bytes, Reply]]:
        """Drop the jobs of a failed batch, each answered with a Rejected."""
        replies: list[tuple[bytes, Reply]] = []
        for job in {id(job): job for job in jobs}.values():
            self._jobs.remove(job)
            self._pending_inputs -= len(job.embed.inputs) - job.next_input
            code = ErrorCode.DECODE_FAILED.value
            replies.append((job.gateway, Rejected(job.embed.request_id, code, message)))
            if self.on_done is not None:
                self.on_done(job.embed, job.offered_at, time.monotonic(), message)
        return replies

    def close(self) -> None:
        if self.ctx:
            llama.llama_free(self.ctx)
            self.ctx = None
