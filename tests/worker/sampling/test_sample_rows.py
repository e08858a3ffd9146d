"""sample_rows: one argmax for a tick's plain greedy rows, each other row through its sampler."""

from __future__ import annotations

import threading

import llama_cpp  # noqa: F401  (libgomp in the process, as in the worker)
import numpy as np
import pytest

from loomserve.protocol import SamplingParams
from loomserve.worker.sampling import samplers as samplers_module
from loomserve.worker.sampling.draw import draw_tokens
from loomserve.worker.sampling.samplers import (
    MAX_SAMPLING_THREADS,
    PARALLEL_ROWS,
    HostSampler,
    SamplingThreads,
    sample_rows,
)


class Chained:
    """A stand-in for a sampler chain: records what it was asked and answers a fixed token."""

    plain_greedy = False

    def __init__(self, token: int) -> None:
        self.token = token
        self.asked: list[int] = []

    def sample(self, batch_index: int, logits: np.ndarray) -> int:
        self.asked.append(batch_index)
        return self.token


@pytest.mark.parametrize("n_chained", [0, 1, 3, 4])
def test_greedy_rows_take_the_first_maximum_and_the_others_their_sampler(n_chained):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    logits[0, 7] = logits[0, 9] = 10.0  # a tie: the first maximum wins, as in llama.cpp
    chained = [Chained(1000 + row) for row in range(n_chained)]
    samplers = [
        *chained,
        *(HostSampler(SamplingParams(temperature=0.0), 256) for _ in range(4 - n_chained)),
    ]
    tokens = sample_rows(samplers, [10, 20, 30, 40], logits)
    for row, token in enumerate(tokens):
        if row < n_chained:
            assert token == 1000 + row and chained[row].asked == [10 * (row + 1)]
        else:
            assert token == int(np.argmax(logits[row]))
    if n_chained == 0:
        assert tokens[0] == 7


def test_threads_draw_the_same_tokens_as_one_thread():
    """Host-sampled rows shared out among threads: each row's sampler is its own, so the
    tokens are those of one thread, row for row (seeded), beside greedy and chained rows."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((24, 5000)).astype(np.float32) * 3

    def samplers() -> list:
        out: list = []
        for row in range(24):
            if row % 6 == 0:
                out.append(Chained(7))
            elif row % 6 == 1:
                out.append(HostSampler(SamplingParams(temperature=0.0), 256))
            else:
                params = SamplingParams(temperature=1.0, top_p=0.9, seed=row)
                out.append(HostSampler(params, 256))
        return out

    indices = list(range(24))
    alone = sample_rows(samplers(), indices, logits)
    threads = SamplingThreads(3)
    try:
        assert sample_rows(samplers(), indices, logits, threads) == alone
    finally:
        threads.close()
    assert alone[0] == 7 and alone[1] == int(np.argmax(logits[1]))


def test_sampling_threads_stop_at_the_most_that_still_pay():
    """A worker given 16 cores draws with at most MAX_SAMPLING_THREADS threads: past that the
    threads queue for the GIL and a tick's draws take longer (measured, docs/gpu.md)."""
    many, few = SamplingThreads(16), SamplingThreads(2)
    try:
        assert many.n == MAX_SAMPLING_THREADS < 16
        assert many.pool is not None and many.pool._max_workers == MAX_SAMPLING_THREADS - 1
        assert few.n == 2
    finally:
        many.close()
        few.close()


@pytest.mark.parametrize("n_rows", [PARALLEL_ROWS - 1, PARALLEL_ROWS])
def test_host_rows_are_shared_out_from_parallel_rows_on(monkeypatch, n_rows):
    """Under PARALLEL_ROWS host-sampled rows the tick's own thread draws them all, in one
    call: waking a helper costs more than it saves (measured: sampling.py). From
    PARALLEL_ROWS on, each of two threads draws half of them."""
    where: list[tuple[str, int]] = []

    def recorded(logits, rows, *rest):
        where.append((threading.current_thread().name, len(rows)))
        return draw_tokens(logits, rows, *rest)

    monkeypatch.setattr(samplers_module, "draw_tokens", recorded)
    logits = np.random.default_rng(1).standard_normal((n_rows, 500)).astype(np.float32)
    samplers = [HostSampler(SamplingParams(temperature=1.0, seed=row), 64) for row in range(n_rows)]
    threads = SamplingThreads(2)
    threads.openmp = False  # the Python helpers, as where llama.cpp has no OpenMP threads
    try:
        sample_rows(samplers, list(range(n_rows)), logits, threads)
    finally:
        threads.close()
    own = threading.current_thread().name
    if n_rows < PARALLEL_ROWS:
        assert where == [(own, n_rows)]
    else:
        assert sorted(n for _, n in where) == [n_rows // 2, n_rows - n_rows // 2]
        assert own in [name for name, _ in where]
        assert any(name.startswith("sampling") for name, _ in where)


def test_a_ticks_plain_draws_are_one_call_and_each_samplers_own_tokens(monkeypatch):
    """The sampled rows are drawn in one call into C, on llama.cpp's OpenMP threads; or,
    without them, each Python thread its share in one call; rows with penalties or a logit
    bias among them, written into the row for the call. The tokens are those each sampler's
    sample() gives its row alone (a copy of it, adjusted), tick after tick, beside greedy
    rows; and the logits are as they were after."""
    calls: list[tuple[int, int]] = []

    def counted(logits, rows, cuts, rngs, hints, threads=1):
        calls.append((len(rows), threads))
        return draw_tokens(logits, rows, cuts, rngs, hints, threads)

    monkeypatch.setattr(samplers_module, "draw_tokens", counted)
    mixes = [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.95},
        {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
        {"temperature": 1.0, "min_p": 0.1},
        {"temperature": 1.0, "frequency_penalty": 0.5},
        {"temperature": 1.0, "logit_bias": {3: 2.0}},
        {"temperature": 0.0},
    ]
    n_rows = 3 * len(mixes)  # PARALLEL_ROWS or more: shared out among the threads

    def samplers() -> list[HostSampler]:
        return [
            HostSampler(SamplingParams(seed=row, **mixes[row % len(mixes)]), 256)
            for row in range(n_rows)
        ]

    for openmp in (False, True):
        alone, together = samplers(), samplers()
        rng = np.random.default_rng(9)
        threads = SamplingThreads(3)
        assert threads.openmp  # llama.cpp (imported above) runs on OpenMP threads
        threads.openmp = openmp
        try:
            for _ in range(4):
                logits = (rng.standard_normal((n_rows, 3000)) * 3).astype(np.float32)
                given = logits.copy()
                calls.clear()
                tokens = sample_rows(together, list(range(n_rows)), logits, threads)
                assert np.array_equal(logits, given)
                assert tokens == [s.sample(0, row) for s, row in zip(alone, logits, strict=True)]
                # 18 sampled rows: one call on 3 OpenMP threads; or a call each for 3 threads
                assert sorted(calls) == ([(18, 3)] if openmp else [(6, 1)] * 3)
        finally:
            threads.close()


@pytest.mark.parametrize("openmp", [False, True])
@pytest.mark.parametrize("n_threads", [2, 3])
def test_many_greedy_rows_are_shared_out_and_keep_their_first_maximum(n_threads, openmp):
    """From PARALLEL_ROWS greedy rows on, each Python thread takes the argmax of a share of
    them; on llama.cpp's OpenMP threads, one call takes them all, with no Python helper. The
    tokens are one argmax's, row for row, ties to the first maximum."""
    rows = PARALLEL_ROWS + 5
    logits = np.random.default_rng(3).standard_normal((rows, 3000)).astype(np.float32)
    logits[rows - 1, 11] = logits[rows - 1, 12] = 9.0  # a tie in the last thread's share
    samplers = [HostSampler(SamplingParams(temperature=0.0), 256) for _ in range(rows)]
    threads = SamplingThreads(n_threads)
    threads.openmp = openmp
    asked: list[str] = []
    assert threads.pool is not None
    submit = threads.pool.submit

    def recorded(*args, **kwargs):
        asked.append("helper")
        return submit(*args, **kwargs)

    threads.pool.submit = recorded  # type: ignore[method-assign]
    try:
        tokens = sample_rows(samplers, list(range(rows)), logits, threads)
    finally:
        threads.close()
    assert tokens == logits.argmax(axis=1).tolist()
    assert tokens[rows - 1] == 11
    assert asked == ([] if openmp else ["helper"] * (n_threads - 1))


@pytest.mark.parametrize("n_plain_greedy", [0, 6])
@pytest.mark.parametrize("writeable", [True, False])
def test_greedy_rows_with_a_bias_or_penalties_take_the_adjusted_rows_argmax(
    n_plain_greedy, writeable
):
    """A greedy request's bias and penalties are written into its row for the tick's argmax
    (all rows' at once when most are greedy, else its own), and the row put back after; with
    read-only logits each such row is adjusted on a copy. Either way the tokens are those of
    sample() on the row alone, tick after tick, as the penalties' history grows."""
    mixes = [
        {"temperature": 0.0, "repeat_penalty": 1.5, "presence_penalty": 0.5},
        {"temperature": 0.0, "frequency_penalty": 2.0},
        {"temperature": 0.0, "logit_bias": {5: 50.0, 6: -float("inf")}},
        {"temperature": 1.0, "presence_penalty": 1.0},
    ]
    n_rows = len(mixes) + n_plain_greedy

    def samplers() -> list[HostSampler]:
        return [
            HostSampler(SamplingParams(seed=row, **mixes[row] if row < len(mixes) else {}), 64)
            for row in range(n_rows)
        ]

    alone, together = samplers(), samplers()
    rng = np.random.default_rng(4)
    for _ in range(6):
        # Few distinct best tokens, so that the penalties soon change the argmax.
        logits = (rng.standard_normal((n_rows, 300)) * 0.3).astype(np.float32)
        logits[:, :4] += 3.0
        given = logits.copy()
        logits.flags.writeable = writeable
        tokens = sample_rows(together, list(range(n_rows)), logits)
        assert np.array_equal(logits, given)
        assert tokens == [s.sample(0, row) for s, row in zip(alone, logits, strict=True)]
        assert tokens[2] == 5
    assert len(set(alone[1]._generated)) > 1  # the frequency penalty moved it off its first
