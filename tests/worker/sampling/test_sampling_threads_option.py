"""--sampling-threads: how many threads draw a tick's host-sampled rows. 0 (the default) gives
one per llama.cpp thread up to MAX_SAMPLING_THREADS; a number given is taken as it is (a
machine with many cores may want more), and the tokens do not depend on it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from loomserve.protocol import Generate, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.sampling.samplers import MAX_SAMPLING_THREADS
from loomserve.worker.tick.loop import TickLoop
from tests.worker.engine.test_engine import GW, Collector, drain


@pytest.mark.parametrize(
    ("threads", "sampling_threads", "expected"),
    [
        (1, 0, 1),
        (MAX_SAMPLING_THREADS + 4, 0, MAX_SAMPLING_THREADS),
        (1, MAX_SAMPLING_THREADS + 2, MAX_SAMPLING_THREADS + 2),
        (2, 1, 1),
    ],
)
def test_the_worker_draws_on_the_threads_it_is_given(
    tiny_model_path: Path, threads: int, sampling_threads: int, expected: int
) -> None:
    config = WorkerConfig(
        model_path=tiny_model_path, slots=2, ctx_size=64, threads=threads,
        sampling_threads=sampling_threads,
    )  # fmt: skip
    engine = Engine(config)
    try:
        loop = TickLoop(engine, config, Collector())
        assert loop.sampling_threads.n == expected
        loop.sampling_threads.close()
    finally:
        engine.close()


def test_seeded_text_is_the_same_on_any_number_of_sampling_threads(tiny_model_path: Path) -> None:
    base = WorkerConfig(model_path=tiny_model_path, slots=6, ctx_size=64, threads=1)
    texts = []
    for sampling_threads in (1, 3):
        config = replace(base, sampling_threads=sampling_threads)
        engine = Engine(config)
        try:
            loop = TickLoop(engine, config, collector := Collector())
            for i in range(6):
                params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=i)
                loop.inbox.submit(GW, Generate(f"r{i}", [1, 5 + i, 9], params))
            drain(loop)
            texts.append(collector.tokens())
            loop.sampling_threads.close()
        finally:
            engine.close()
    assert texts[0] == texts[1]
    assert len({tuple(tokens) for tokens in texts[0].values()}) > 1


def test_a_negative_number_of_sampling_threads_is_refused(tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match="sampling_threads must not be negative"):
        WorkerConfig(model_path=tiny_model_path, sampling_threads=-1)
