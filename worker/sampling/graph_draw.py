"""The host sampler's draw inside llama_decode (`--backend-sampling draw`): graphdraw.c
attached to a sequence as a llama.cpp backend sampler draws its token on llama.cpp's own
threads from the output layer's row, so llama.cpp copies no logits for the pass.

Why: when a pass's rows are sampled on the host, llama.cpp first copies all their logits out
of its graph with one memcpy on one thread: on this project's 2-core Xeon (Gemma 3 270M,
262,144 tokens) 2.6 ms of an 81 ms pass at 16 rows and 10.5 ms of 272 at 64, more than the
draws cost. llama.cpp's own backend samplers (backend_sampling.py) skip that copy but pad
another copy of the logits and sort the whole vocabulary. graphdraw.c reads the row where the
output layer wrote it and draws as the host does (rowdraw.c), from the seed and settings the
request's HostSampler gives it before the pass: the same tokens, seeded or not, as the host
path.

Which requests: every request without a grammar, logprobs (of the output or the prompt), a
logit bias or penalties (backend_sampling.draws_plain_rows), greedy or sampled with any
temperature, top-k, top-p and min-p. The others are sampled on the host as before; in a pass
with one of them llama.cpp copies every row's logits, and the drawn rows are read from the
graph all the same. Drawn requests do not draft: drafts' verification samples each row on the host.

Attaching a sampler makes llama.cpp plan its graph again (about 8 ms at 16 slots here), so a
sequence keeps its sampler from the first pass a drawn request samples in it, and only loses
it when a host-sampled request takes an output there (its logits must then be copied), or
for a pass with many outputs (a prompt scored for logprobs, drafts verified), for which
llama.cpp would otherwise hold three more rows of the vocabulary's size per output.
Between passes the worker rewrites each sequence's DrawState: what graphdraw.c reads is
always the request now in that slot.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import llama_cpp as llama
import numpy as np
import structlog

from ..sched.slots import Run
from . import rowscan
from .backend_sampling import (
    backend_sampling_available,
    sampler_chain,
    set_sampler,
)
from .samplers import HostSampler

log = structlog.get_logger(__name__)


class DrawState(ctypes.Structure):
    """graphdraw.c's GraphDraw: one sequence's next draw, written before a pass, read after."""

    _fields_ = [
        ("settings", ctypes.c_double * 5),  # temperature, top_k, top_p, min_p, span
        ("seed", ctypes.c_uint64),
        ("greedy", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("scratch", ctypes.c_void_p),
        ("token", ctypes.c_int64),
        ("found", ctypes.c_double * 2),
        ("arrived", ctypes.c_int),
        ("nan", ctypes.c_int),
    ]


@functools.cache
def graph_draw_library() -> Any | None:
    """csrc/sampling's library with its graph calls bound (not yet to ggml: the engine binds
    them where worker/engine/native_fence.py allows, worker/engine/kernels.py's
    graph_native); None where the draw cannot run in the graph: no C draw, or a llama.cpp
    without backend sampling."""
    lib = rowscan.library()
    if lib is None or not backend_sampling_available():
        return None
    if lib.ls_graph_draw_bytes() != ctypes.sizeof(DrawState):
        return None
    return lib


def outputs_of(run: Run) -> int:
    """The rows of logits a run asks of the pass."""
    if run.score:
        return len(run.tokens)
    return 1 + run.draft if run.sample else 0


class GraphDraws:
    """Each sequence's graphdraw.c sampler, and the state it reads.

    Samplers are attached lazily and kept: before a pass (bind), a sequence whose output is a
    drawn request's has its sampler attached (once) and its state rewritten; one whose output
    is a host-sampled request's has it detached, so that llama.cpp copies the logits.
    llama.cpp sets a chain up for the graph once, so each attachment is a new chain.
    """

    def __init__(self, ctx, lib: Any, n_seqs: int, n_vocab: int) -> None:
        self._ctx = ctx
        self._lib = lib
        self._n_vocab = n_vocab
        self._states = (DrawState * n_seqs)()
        # One operation runs at a time: one draw's scratch serves every sequence.
        scratch = np.zeros(lib.ls_draw_scratch_bytes(n_vocab) + 64, dtype=np.uint8)
        offset = -scratch.ctypes.data % 64
        self._scratch = scratch
        for state in self._states:
            state.n = n_vocab
            state.scratch = scratch.ctypes.data + offset
        self._chains: dict[int, Any] = {}  # attached: sequence -> llama.cpp chain
        self.refused = False  # llama.cpp would not take the sampler: everything on the host
        self.prepared = 0  # draws handed to the graph (for tests and benchmarks)

    @property
    def attached(self) -> int:
        """How many sequences have their sampler attached now."""
        return len(self._chains)

    def bind(self, runs: Sequence[Run]) -> None:
        # While any sampler is attached, llama.cpp keeps three more vocabulary-sized arrays
        # for each output of a pass, at least one per sequence: a pass with more outputs
        # than that (a prompt scored for logprobs, drafts verified) would grow them, to
        # gigabytes for a long prompt (1.5 GB for 512 tokens on Gemma). Such a pass runs with
        # none attached; its drawn requests are sampled on the host from the copied rows,
        # the same tokens.
        if sum(map(outputs_of, runs)) > len(self._states):
            for seq in list(self._chains):
                self._detach(seq)
            return
        for run in runs:
            if not (run.sample or run.score):
                continue
            seq = run.slot.index
            sampler = run.slot.occupant.chain
            if isinstance(sampler, HostSampler) and sampler.graph_draw and self._attach(seq):
                sampler.prepare(self._states[seq], self._n_vocab)
                self.prepared += 1
            else:
                self._detach(seq)

    def _attach(self, seq: int) -> bool:
        if seq in self._chains:
            return True
        if self.refused:
            return False
        stage = llama.llama_sampler_init(
            ctypes.cast(self._lib.ls_graph_iface(), ctypes.POINTER(llama.llama_sampler_i)),
            ctypes.c_void_p(ctypes.addressof(self._states[seq])),
        )
        chain = sampler_chain([stage])
        if not set_sampler(self._ctx, seq, chain):
            llama.llama_sampler_free(chain)
            self.refused = True
            log.warning("llama.cpp refused the draw in the graph; sampling on the host")
            return False
        self._chains[seq] = chain
        return True

    def _detach(self, seq: int) -> None:
        chain = self._chains.pop(seq, None)
        if chain is not None:
            if self._ctx is not None:
                set_sampler(self._ctx, seq, None)
            llama.llama_sampler_free(chain)

    def close(self) -> None:
        """The context is about to be freed: every chain off it first."""
        for seq in list(self._chains):
            self._detach(seq)
        self._ctx = None
