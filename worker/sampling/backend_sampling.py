"""Backend sampling: llama.cpp samples a request's token inside llama_decode, on the device
that ran the forward pass (llama.cpp's "backend sampling", llama-server's --backend-sampling).

Why: the host sampler (draw.py) reads every row of 262,144 logits on the host; on a GPU that
means copying each row off the device and a pass over it per token, host work that grows with
the slots while the forward pass barely does (vLLM samples the whole batch on the GPU for the
same reason). With backend sampling the sampler chain runs in the graph and only the token
comes back; when every output of a pass is sampled this way llama.cpp copies no logits at all.
On a CPU it is the other way round: the graph's sampler sorts and sums the whole vocabulary
where the host sampler looks at its head only. On an H100 the host's C draw (rowdraw.c) beat
the graph too, at every mix, so `--backend-sampling auto` leaves it off: only `on` samples in
the graph (docs/sampling.md, docs/gpu.md).

Which requests: those the graph samples exactly as the host sampler does, and no slower —
greedy, or temperature with top-k, top-p and min-p (llama.cpp's chain order, as the host
sampler's), with or without a seed; a top-p needs a top-k before it (backend_eligible). A
grammar, logprobs, a logit bias or penalties take the host path, in the
same pass: llama.cpp then copies the logits of every row, and those rows are sampled as
before. Sampled requests do not draft (speculation): a draft's verification would draw random
numbers for tokens that are thrown away, and how many depends on the batch.

A chain is attached to the sequence of its request's slot (llama_set_sampler) before the
first pass it samples in, and detached when another request's output runs in that sequence
or when the request ends (GraphChains). llama.cpp sets a chain up for the graph once: a
request that moves to another slot (preempted, resumed) continues on a clone, whose random
generator goes on where it stopped, so a seeded request gives the same text however it was
scheduled.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import Any

import llama_cpp as llama
import numpy as np
import structlog

from ...protocol import SamplingParams
from ..sched.slots import Run, TokenSampler

log = structlog.get_logger(__name__)

LLAMA_TOKEN_NULL = -1


def _bind() -> Any | None:
    """llama.cpp's backend sampling calls, which llama-cpp-python 0.3.36 does not bind;
    None when the library has none (an older llama.cpp)."""
    lib = getattr(getattr(llama, "llama_cpp", None), "_lib", None)
    if lib is None or not hasattr(lib, "llama_set_sampler"):
        return None
    lib.llama_set_sampler.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]
    lib.llama_set_sampler.restype = ctypes.c_bool
    lib.llama_get_sampled_token_ith.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    lib.llama_get_sampled_token_ith.restype = ctypes.c_int32
    return lib


_LIB = _bind()


def backend_sampling_available() -> bool:
    """Whether this llama.cpp can sample inside the graph."""
    return _LIB is not None


def set_sampler(ctx, seq: int, chain) -> bool:
    """llama_set_sampler: a chain onto the sequence (None: off it); False if refused."""
    assert _LIB is not None, "this llama.cpp has no backend sampling"
    return bool(_LIB.llama_set_sampler(ctx, seq, chain))


def draws_plain_rows(params: SamplingParams) -> bool:
    """Whether the request's token is drawn from its row of logits as the decode left it:
    no grammar, no logprobs to read from it, no logit bias or penalties to write into it.
    Those requests can be sampled inside llama_decode (here, and graph_draw.py)."""
    return (
        not params.grammar
        and params.logprobs is None
        and params.prompt_logprobs is None
        and not params.logit_bias
        and not params.penalized
    )


def backend_eligible(params: SamplingParams, n_vocab: int) -> bool:
    """Whether the graph's sampler chain samples this request exactly as the host would, and
    no slower.

    A top_p with no top-k before it stays on the host: the graph's top-p sorts the whole
    vocabulary for every row (measured on an H200 at 64 slots and 262,144 tokens: 47 ms a
    tick against the host sampler's 20 ms, docs/gpu.md), where the host sums the row's
    mass in one pass and sorts only the tokens near the best (draw.py)."""
    # A top-k of n_vocab cuts nothing.
    return (params.top_p >= 1.0 or 0 < params.top_k < n_vocab) and draws_plain_rows(params)


def drawing_stages(params: SamplingParams, n_vocab: int) -> list[llama.llama_sampler_p]:
    """llama.cpp's samplers that pick the token: greedy, or top-k, top-p, min-p, temperature
    and dist, in that order, as the graph runs them. A top-k that keeps the whole vocabulary
    is left out: the graph's top-k needs k below it."""
    if params.greedy:
        return [llama.llama_sampler_init_greedy()]
    stages = []
    if 0 < params.top_k < n_vocab:
        stages.append(llama.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        stages.append(llama.llama_sampler_init_top_p(params.top_p, 1))
    if params.min_p > 0.0:
        stages.append(llama.llama_sampler_init_min_p(params.min_p, 1))
    stages.append(llama.llama_sampler_init_temp(params.temperature))
    seed = llama.LLAMA_DEFAULT_SEED if params.seed is None else params.seed
    stages.append(llama.llama_sampler_init_dist(seed))
    return stages


def sampler_chain(stages: list[llama.llama_sampler_p]) -> llama.llama_sampler_p:
    """A llama.cpp sampler chain of the stages, which it then owns and frees."""
    chain_params = llama.llama_sampler_chain_default_params()
    chain_params.no_perf = True
    chain = llama.llama_sampler_chain_init(chain_params)
    for stage in stages:
        llama.llama_sampler_chain_add(chain, stage)
    return chain


class BackendSampler:
    """A request sampled in the graph: sample() reads the token llama_decode drew."""

    __slots__ = ("_chain", "_chains", "_host", "failure", "seq", "used")

    grammar_complete = False  # no grammar
    plain_greedy = False  # its row's logits may not be on the host at all
    # A draft's verification in the graph would draw random numbers for tokens then thrown
    # away, how many depending on the batch: a seeded request would not repeat.
    verifies_drafts = False

    def __init__(
        self, chain: llama.llama_sampler_p, chains: GraphChains, host: TokenSampler
    ) -> None:
        self._chain: llama.llama_sampler_p | None = chain
        self._chains = chains
        # Where llama.cpp would not take the chain: the row was copied, the host samples it.
        self._host = host
        self.seq: int | None = None  # the sequence it is attached to
        self.used = False  # set up for the graph once: a new sequence needs a clone
        self.failure: str | None = None

    def sample(self, batch_index: int, logits: np.ndarray) -> int:
        """The token the last decode drew at batch_index; the host's from `logits` when the
        chain could not be attached."""
        if self.seq is None:
            return self._host.sample(batch_index, logits)
        token = self._chains.sampled_token(batch_index)
        if token == LLAMA_TOKEN_NULL:
            self.failure = "llama.cpp's backend sampler gave no token"
            return 0
        return token

    @property
    def drawn_in_graph(self) -> bool:
        """Whether the last pass drew its token: its chain was attached to a sequence."""
        return self.seq is not None

    @property
    def in_graph(self) -> bool:
        """Whether it samples in the graph (False once llama.cpp refused its chain)."""
        return self._chain is not None

    def attach(self, seq: int) -> bool:
        """Attach the chain to the sequence (a clone when it was attached before); when
        llama.cpp refuses it, the request samples on the host from then on."""
        if self._chain is None:
            return False
        if self.used:
            clone = llama.llama_sampler_clone(self._chain)
            llama.llama_sampler_free(self._chain)
            self._chain = clone
        self.used = True
        if not self._chains.set_chain(seq, self._chain):
            llama.llama_sampler_free(self._chain)
            self._chain = None
            return False
        self.seq = seq
        return True

    def close(self) -> None:
        self._chains.leave(self)
        if self._chain is not None:
            llama.llama_sampler_free(self._chain)
            self._chain = None


class GraphChains:
    """Which BackendSampler each sequence of the context has attached.

    llama.cpp keeps a pointer to an attached chain and runs it for every output of its
    sequence, so a chain is detached before it is freed, and before a host-sampled request
    takes an output in that sequence (its logits would not be copied otherwise).
    """

    def __init__(self, ctx) -> None:
        if _LIB is None:
            raise RuntimeError("this llama.cpp has no backend sampling")
        self._lib: Any = _LIB
        self._ctx = ctx
        self._by_seq: dict[int, BackendSampler] = {}
        self.tokens_read = 0  # tokens the graph drew, read back (for tests and benchmarks)

    def bind(self, runs: Iterable[Run]) -> None:
        """Before a pass: each run with outputs gets its own request's chain attached, or
        none for a host-sampled request."""
        for run in runs:
            if not (run.sample or run.score):
                continue
            seq = run.slot.index
            wanted = run.slot.occupant.chain
            sitting = self._by_seq.get(seq)
            if sitting is wanted:
                continue
            if sitting is not None:
                self._detach(sitting)
            if isinstance(wanted, BackendSampler) and wanted.in_graph:
                if wanted.seq is not None:  # it moved: off its old sequence first
                    self._detach(wanted)
                if wanted.attach(seq):
                    self._by_seq[seq] = wanted
                else:  # llama.cpp logged why; this request samples on the host
                    log.warning("backend sampler refused; sampling on the host", seq=seq)

    def sampled_token(self, batch_index: int) -> int:
        self.tokens_read += 1
        return int(self._lib.llama_get_sampled_token_ith(self._ctx, batch_index))

    def set_chain(self, seq: int, chain: llama.llama_sampler_p | None) -> bool:
        """llama_set_sampler: the chain onto the sequence (None: off it); False if refused."""
        return set_sampler(self._ctx, seq, chain)

    def leave(self, sampler: BackendSampler) -> None:
        """The request ended: its chain off its sequence, before it is freed."""
        if sampler.seq is not None and self._ctx is not None:
            self._detach(sampler)

    def close(self) -> None:
        """The context is about to be freed: nothing may be detached from it after."""
        for sampler in list(self._by_seq.values()):
            self._detach(sampler)
        self._ctx = None

    def _detach(self, sampler: BackendSampler) -> None:
        seq = sampler.seq
        if seq is None:
            return
        if self._ctx is not None:
            self.set_chain(seq, None)
        if self._by_seq.get(seq) is sampler:
            del self._by_seq[seq]
        sampler.seq = None
