"""Per-request samplers, built from SamplingParams at acceptance and freed when the request ends,
so grammar, penalty and RNG state never leak from one request to the next in a slot.

A request without a grammar gets a HostSampler: its token is drawn on the host from the row
of logits the loop hands it (draw.py: exact, at about the cost of an argmax; every row in one
call to rowdraw.c, which holds no GIL, so the sampling threads draw side by side), with the
request's own random generator, so a seeded request gives the same text alone, batched and
after a restart. Logit bias and penalties are applied first, as llama.cpp's samplers apply
them (logprobs.logit_adjustments): in a tick, written into the request's own row and put
back after (sample_rows); alone (sample()), on a copy of the row. Greedy requests take the
argmax; sample_rows takes those for a whole tick at once (rowscan's argmax, in C).

With backend sampling on (backend_sampling.py), a request the graph samples exactly gets a
BackendSampler instead: llama_decode draws its token, the host only reads it.

A request with a grammar is a HostSampler too: its token is drawn as any other (in C, with
the tick's other rows), then its grammar (guidance.py, on llguidance) is asked about that one
token, and only when it refuses is the token drawn again from the tokens the grammar allows
(about 0.1 ms to read the mask over 262,144 tokens), as llama.cpp's common_sampler_sample
does. The grammar advances by the kept token only. A greedy request's token is then the one
masking first gives: the first maximum over all tokens, when the grammar allows it, is the
first maximum over those it allows; a sampled one's, a draw refused and drawn again from the
allowed tokens, is a draw from the masked distribution.

Penalties see the generated tokens only, not the prompt, as in llama-server.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeGuard

import numpy as np

from ...protocol import SamplingParams
from ...protocol.limits import MAX_LOGIT_BIAS
from ..sched.slots import TokenSampler
from . import rowscan
from .backend_sampling import (
    BackendSampler,
    GraphChains,
    backend_eligible,
    drawing_stages,
    draws_plain_rows,
    sampler_chain,
)
from .draw import (
    Truncation,
    draw_settings,
    draw_token,
    draw_tokens,
)
from .guidance import (
    GrammarFailed,
    GrammarState,
    GrammarVocab,
    request_grammar,
)
from .logprobs import adjusted_logits, logit_adjustments

if TYPE_CHECKING:
    from .graph_draw import DrawState

# Fewer rows than this in a tick, sampled or greedy, for Python helper threads (where there
# are no OpenMP threads to draw on, and for rows drawn one by one): the tick's own thread
# reads them all, since handing rows to a helper costs more than it saves. The C draw reads a
# row in ~75-190 us (warm or fresh from llama_decode) and a helper takes ~250 us to wake, and
# on a CPU llama.cpp's OpenMP threads hold the other cores for a few ms after each decode
# (worker/openmp.py). On this project's 2 cores (Gemma 3 270M, host time per tick outside
# llama_decode, ms, one thread against two): 4 rows 0.72-0.77 against 0.94-0.96
# (temperature 1), 8 rows 1.27-1.33 against 1.51-1.54, 12 rows 1.79-1.88 against 2.06-2.14;
# 16 rows 2.30 against 1.89, and at 64 rows 8.2 against 4.8 (greedy: 5.8 against 3.4).
# llama.cpp's OpenMP threads, awake already, take from 2 rows on (rowthreads.c).
PARALLEL_ROWS = 16
# More threads than this drew a tick's rows more slowly, not faster. Measured on an H100
# machine's 16 cores (64 rows, host work per tick, docs/gpu.md): with numpy's draws, T 0.7 +
# top_p 0.95 took 47 ms on 1 thread, 26 on 4, 32 on 8, 40 on 16; with the C draw, a call a
# row, 16.9, 9.1, 10.3 and 10.4 (temperature 1: 14.9, 8.4, 10.7, 10.7): each call takes the
# GIL back. A thread's draws are one call since (ls_draw_rows); whether more threads pay now
# is not measured.
MAX_SAMPLING_THREADS = 4


class InvalidSampling(ValueError):
    """The request's sampling settings cannot run on this model (bad grammar, bad token id)."""


class HostSampler:
    """One request's sampling state: each token drawn on the host from its row of logits
    (draw.py), with the request's own random generator, then checked against its grammar, if
    it has one.

    With `graph_draw` (a request without a grammar, bias or penalties, on a worker that draws
    inside llama_decode: graph_draw.py), graphdraw.c draws the same token inside the pass
    where its sequence's sampler is attached: the sampler writes its settings and the seed
    its generator gives into the sequence's DrawState before the pass (prepare), and reads the
    token after (sample); a pass that ran without it attached leaves the row to the host.

    After a token: `failure` says why the request must end with an error (its grammar grew
    too complex, or allows none of the tokens the request may produce; the token is then
    meaningless), and `grammar_complete` whether its grammar allows nothing more but an
    end-of-generation token."""

    __slots__ = (
        "_adjusts",
        "_context",
        "_cut",
        "_drawn",
        "_generated",
        "_grammar",
        "_mass",
        "_params",
        "_rng",
        "failure",
        "grammar_complete",
        "graph_draw",
    )

    def __init__(
        self,
        params: SamplingParams,
        slot_context: int,
        grammar: GrammarState | None = None,
        graph_draw: bool = False,
    ) -> None:
        self._params = params
        self._context = slot_context
        self._cut = (
            None
            if params.greedy
            else Truncation(params.temperature, params.top_k, params.top_p, params.min_p)
        )
        # seed None: fresh entropy from the OS, so unseeded requests differ.
        self._rng = np.random.default_rng(params.seed)
        self._adjusts = bool(params.logit_bias) or params.penalized
        self._generated: list[int] = []  # the penalties' history, when they apply
        self._mass = 1.0  # its last row's head mass: how wide the next head should be
        self._grammar = grammar  # checked after the draw, never before it
        self.failure: str | None = None
        self.grammar_complete = False
        self.graph_draw = graph_draw
        self._drawn: DrawState | None = None  # the state graphdraw.c draws into this pass

    @property
    def plain_greedy(self) -> bool:
        """Whether the token is the logits' argmax and nothing else (no state to update); not
        for a request drawn in the graph, whose row may never reach the host."""
        return (
            self._cut is None
            and not self._adjusts
            and self._grammar is None
            and not self.graph_draw
        )

    @property
    def verifies_drafts(self) -> bool:
        """Whether it may verify drafted tokens (speculation.py samples each row in turn on
        the host): not a request drawn in the graph, which does not draft."""
        return not self.graph_draw

    @property
    def drawn_in_graph(self) -> bool:
        """Whether graphdraw.c drew its token in the last pass (prepare() before it)."""
        return self._drawn is not None

    def prepare(self, state: DrawState, n_vocab: int) -> None:
        """Before a pass that draws its token in the graph: its next draw into its
        sequence's state, the settings and the seed draw_rows would hand rowdraw.c (the seed
        taken from its generator now); a greedy request's is the argmax."""
        state.greedy = self._cut is None
        if self._cut is not None:
            state.settings[:] = draw_settings(self._cut, n_vocab, self._mass)
            state.seed = self._rng.bit_generator.random_raw()
        state.token = -1
        self._drawn = state

    @property
    def greedy(self) -> bool:
        """Whether its token is the argmax of its row (after any bias and penalties)."""
        return self._cut is None

    @property
    def adjusts(self) -> bool:
        """Whether it applies a logit bias or penalties to its rows."""
        return self._adjusts

    @property
    def constrained(self) -> bool:
        """Whether a grammar checks its tokens (constrain(), after the draw)."""
        return self._grammar is not None

    def adjust(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Writes its bias and penalties into `row` (its own row of a tick's logits) and gives
        back what to put back: those tokens' ids and former logits (None: nothing changed).
        The token drawn from the row must then be told to taken()."""
        adjustments = logit_adjustments(row, self._params, self._generated, self._context)
        if adjustments is None:
            return None
        ids, values = adjustments
        former = row[ids]
        row[ids] = values
        return ids, former

    def taken(self, token: int) -> None:
        """The token drawn from a row adjust() wrote into: its penalties' history."""
        if self._adjusts:
            self._generated.append(token)

    @staticmethod
    def draw_rows(
        samplers: Sequence[HostSampler], rows: Sequence[int], logits: np.ndarray, threads: int = 1
    ) -> list[int]:
        """sample() for each of `samplers` (sampled, not greedy) with its row of `logits`,
        the same tokens, in one call into C for them all (on `threads` of llama.cpp's OpenMP
        threads, where it has them). A bias or penalties must be in the rows already
        (adjust(), then taken())."""
        if not samplers:
            return []
        drawn = draw_tokens(
            logits,
            rows,
            [sampler._cut for sampler in samplers if sampler._cut is not None],
            [sampler._rng for sampler in samplers],
            [sampler._mass for sampler in samplers],
            threads,
        )
        for sampler, (_, mass) in zip(samplers, drawn, strict=True):
            sampler._mass = mass
        return [token for token, _ in drawn]

    def sample(self, batch_index: int, logits: np.ndarray) -> int:
        """The token for this row of logits (batch_index is not needed: the row is given),
        or the one graphdraw.c drew in the last pass, where it did."""
        if self._drawn is not None:
            state, self._drawn = self._drawn, None
            if self._cut is not None:  # its head's mass, the next draw's hint (not greedy's)
                self._mass = state.found[0]
            return int(state.token)
        scores = logits
        if self._adjusts:
            scores = adjusted_logits(logits, self._params, self._generated, self._context)
        if self._cut is None:
            token = int(scores.argmax())
        else:
            token, self._mass = draw_token(scores, self._cut, self._rng, self._mass)
        if self._grammar is not None:
            token = self.constrain(token, scores)
        if self._adjusts:
            self._generated.append(token)
        return token

    def constrain(self, token: int, row: np.ndarray) -> int:
        """The token drawn from `row` (its bias and penalties in it), or, where the grammar
        refuses it, one drawn again from the tokens it allows; the grammar then advances by
        it. Sets `failure` where nothing can be kept."""
        grammar = self._grammar
        if grammar is None:
            return token
        try:
            if not grammar.allows(token):
                token = self._redraw(grammar.allowed(), row)
                if token < 0:  # every allowed token is at -inf: the bias forbids them
                    self.failure = "the grammar allows none of the tokens the request may produce"
                    return token
            grammar.accept(token)
        except GrammarFailed as exc:
            self.failure = str(exc)
            return token
        self.grammar_complete = grammar.complete()
        return token

    def _redraw(self, allowed: np.ndarray, row: np.ndarray) -> int:
        """A token from `row` over the `allowed` ids alone (-1: none has a finite logit).
        The row cut to those tokens is drawn from exactly as the masked row would be: a
        token at -inf weighs nothing and top-k, top-p and min-p keep the same ones."""
        kept = row[allowed]
        if not len(kept) or not np.isfinite(kept).any():
            return -1
        if self._cut is None:  # the first maximum: ids ascend
            return int(allowed[int(kept.argmax())])
        drawn, self._mass = draw_token(
            np.ascontiguousarray(kept, dtype=np.float32), self._cut, self._rng, self._mass
        )
        return int(allowed[drawn])

    def close(self) -> None:
        """Frees its grammar's step, if it has one."""
        if self._grammar is not None:
            self._grammar.close()
            self._grammar = None


class SamplingThreads:
    """n threads (at most `limit`) that draw a tick's host-sampled rows. Where llama.cpp runs
    on OpenMP threads (its CPU backend), n of those, awake right after the decode, take the
    sampled rows and the greedy rows' argmaxes in C (`openmp`: rowthreads.c). Otherwise, and
    for rows taken one by one (greedy rows among mostly sampled ones, a bias or penalties on
    read-only logits), the tick's own thread and n - 1 helpers."""

    def __init__(self, n: int, limit: int = MAX_SAMPLING_THREADS) -> None:
        self.n = min(max(1, n), limit)
        self.openmp = self.n > 1 and rowscan.on_openmp()
        self.pool = (
            ThreadPoolExecutor(self.n - 1, thread_name_prefix="sampling") if self.n > 1 else None
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


def sample_rows(
    samplers: Sequence[TokenSampler],
    batch_indices: list[int],
    logits: np.ndarray,
    threads: SamplingThreads | None = None,
) -> list[int]:
    """Each sampler's token from its row of `logits` (one row per sampler, in order), whose
    batch indices in the last decode are `batch_indices`.

    When at least half the rows are greedy, one argmax over all rows serves them (the rest is
    wasted work, cheaper than copying the greedy rows out); the others, and every row
    otherwise, go through their own sampler. The host sampler's sampled rows are drawn in one
    call into C (HostSampler.draw_rows), which holds no GIL: on llama.cpp's OpenMP threads
    where it has them, else each thread its share. No two threads touch one sampler.

    A host sampler's logit bias and penalties are written into its own row for the tick and
    the row's logits put back after: they change a few hundred tokens, and copying the 1 MB
    row to change them cost more than the draw itself. Its row is then drawn, or argmaxed,
    with the others. (Read-only logits: a copy, row by row, as sample() makes it.)
    """
    adjusted = {
        row: sampler
        for row, sampler in enumerate(samplers)
        if isinstance(sampler, HostSampler) and sampler.adjusts and logits.flags.writeable
    }
    formers = [(row, sampler.adjust(logits[row])) for row, sampler in adjusted.items()]
    try:
        tokens = _sample_rows(samplers, batch_indices, logits, threads, adjusted)
    finally:
        for row, former in formers:
            if former is not None:
                ids, values = former
                logits[row, ids] = values
    for row, sampler in adjusted.items():
        sampler.taken(tokens[row])
    return tokens


def _sample_rows(
    samplers: Sequence[TokenSampler],
    batch_indices: list[int],
    logits: np.ndarray,
    threads: SamplingThreads | None,
    adjusted: dict[int, HostSampler],
) -> list[int]:
    """sample_rows' draws, the rows in `adjusted` holding their sampler's bias and penalties
    already."""

    argmaxed = [
        sampler.greedy and (not sampler.adjusts or row in adjusted)
        if _on_host(sampler)
        else sampler.plain_greedy
        for row, sampler in enumerate(samplers)
    ]
    if 2 * sum(argmaxed) < len(samplers):
        tokens = [0] * len(samplers)
        rest: Sequence[int] = range(len(samplers))
    else:
        tokens = _argmax_rows(logits, threads)
        rest = [row for row in range(len(samplers)) if not argmaxed[row]]
    plain: list[tuple[int, HostSampler]] = []  # sampled: drawn together
    greedy: list[int] = []  # greedy rows the tick's argmax left (few of its rows were)
    copied: list[int] = []  # a bias or penalties on read-only logits: sample() on a copy
    for row in rest:
        sampler = samplers[row]
        if not _on_host(sampler):
            continue
        if sampler.adjusts and row not in adjusted:
            copied.append(row)
        elif sampler.greedy:
            greedy.append(row)
        else:
            plain.append((row, sampler))
    # On OpenMP threads the tick's thread draws every plain row in its one call; the helpers,
    # if any, take shares of the rows taken one by one.
    openmp_threads = threads.n if threads is not None and threads.openmp else 0
    shared = len(greedy) + len(copied) + (0 if openmp_threads else len(plain))
    pool = None if threads is None or shared < PARALLEL_ROWS else threads.pool
    n_shares = 1 if threads is None or pool is None else threads.n

    def sample(share: int) -> None:
        drawn = (plain if share == 0 else []) if openmp_threads else plain[share::n_shares]
        rows = [row for row, _ in drawn]
        chosen = HostSampler.draw_rows(
            [sampler for _, sampler in drawn], rows, logits, openmp_threads or 1
        )
        for row, token in zip(rows, chosen, strict=True):
            tokens[row] = token
        for row in greedy[share::n_shares]:
            tokens[row] = int(rowscan.argmax_rows(logits[row : row + 1])[0])
        for row in copied[share::n_shares]:
            tokens[row] = samplers[row].sample(batch_indices[row], logits[row])

    futures = [pool.submit(sample, share) for share in range(1, n_shares)] if pool else []
    sample(0)
    for row in rest:  # the graph's rows: read on the tick's thread
        if not _on_host(samplers[row]):
            tokens[row] = samplers[row].sample(batch_indices[row], logits[row])
    for future in futures:
        future.result()
    # Grammars see the drawn tokens (their bias and penalties still in the rows), one at a
    # time: they share the vocabulary's mask buffer. sample() checked the copied rows.
    for row, sampler in enumerate(samplers):
        if isinstance(sampler, HostSampler) and sampler.constrained and row not in copied:
            tokens[row] = sampler.constrain(tokens[row], logits[row])
    return tokens


def _on_host(sampler: TokenSampler) -> TypeGuard[HostSampler]:
    """Whether the sampler's row is drawn here, on the host: a host sampler whose token the
    graph did not draw in the last pass."""
    return isinstance(sampler, HostSampler) and not sampler.drawn_in_graph


def _argmax_rows(logits: np.ndarray, threads: SamplingThreads | None) -> list[int]:
    """Every row's argmax, the rows shared out among llama.cpp's OpenMP threads or among the
    sampling threads (rowscan's argmax lets go of the GIL while it reads them)."""
    n_rows = len(logits)
    if threads is not None and threads.openmp:
        return rowscan.argmax_rows(logits, threads.n).tolist()
    if threads is None or threads.pool is None or n_rows < PARALLEL_ROWS:
        return rowscan.argmax_rows(logits).tolist()
    bounds = [n_rows * i // threads.n for i in range(threads.n + 1)]
    futures = [
        threads.pool.submit(rowscan.argmax_rows, logits[start:end])
        for start, end in itertools.pairwise(bounds[1:])
    ]
    first = rowscan.argmax_rows(logits[: bounds[1]])
    return np.concatenate([first, *(future.result() for future in futures)]).tolist()


def build_sampler(
    params: SamplingParams,
    grammars: GrammarVocab | None,
    n_vocab: int,
    slot_context: int,
    graph_chains: GraphChains | None = None,
    graph_draws: bool = False,
    compiled: GrammarState | None = None,
) -> HostSampler | BackendSampler:
    """A fresh sampler for one request; raises InvalidSampling for a bad grammar or bias.
    With `graph_chains` (backend sampling on), a request the graph samples exactly gets a
    BackendSampler (backend_sampling.py); with `graph_draws` (the C draw in the graph), a
    request the C draw serves gets a HostSampler that graphdraw.c draws for (graph_draw.py).

    The worker checks what it is sent itself, as the gateway did: a peer that speaks the
    protocol directly must not be able to crash a grammar parser. `grammars`: the model's
    (None where no request has a grammar); `compiled`: the request's grammar, compiled
    already off the tick (grammar_compiler.py).
    """
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidSampling(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens")
    for token_id in params.logit_bias:
        if token_id >= n_vocab:
            raise InvalidSampling(f"logit_bias names token {token_id}, beyond the vocabulary")
    if graph_draws and draws_plain_rows(params):
        return HostSampler(params, slot_context, graph_draw=True)
    if graph_chains is not None and backend_eligible(params, n_vocab):
        host = HostSampler(params, slot_context)
        return BackendSampler(sampler_chain(drawing_stages(params, n_vocab)), graph_chains, host)
    grammar = compiled
    if grammar is None and params.grammar:
        grammar = _grammar(params.grammar, grammars)
    return HostSampler(params, slot_context, grammar)


def _grammar(text: str, grammars: GrammarVocab | None) -> GrammarState:
    """The request's grammar (guidance.request_grammar); InvalidSampling naming why not."""
    try:
        return request_grammar(text, grammars)
    except ValueError as exc:
        raise InvalidSampling(str(exc)) from None
