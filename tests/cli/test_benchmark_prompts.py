"""The comparative benchmarks never time a run on prompts its server has already prefilled:
a server keeps them in its prefix cache, and such a run skips its prefill (a sampled load had
been timed on the greedy load's prompts, and speculation's drafts on the no-drafts run's)."""

from __future__ import annotations

import itertools

from benchmarks import bench_sampled, bench_spec, gpu_bench


def test_bench_sampled_gives_every_load_and_round_prompts_of_its_own() -> None:
    seeds = [
        bench_sampled.prompt_seed(round_, load)
        for round_, load in itertools.product(range(5), bench_sampled.LOADS)
    ]
    assert len(set(seeds)) == len(seeds)


def test_bench_spec_gives_every_run_on_one_server_prompts_of_its_own() -> None:
    runs = itertools.product(range(5), bench_spec.LOADS, range(bench_spec.RUNS_PER_SERVER))
    seeds = [bench_spec.prompt_seed(round_, load, run) for round_, load, run in runs]
    assert len(set(seeds)) == len(seeds)


def test_gpu_bench_gives_every_load_and_concurrency_prompts_of_their_own() -> None:
    points = itertools.product(gpu_bench.LOADS, (1, 2, 4, 8, 16, 32, 64, 128))
    seeds = [gpu_bench.prompt_seed(load, concurrency) for load, concurrency in points]
    assert len(set(seeds)) == len(seeds)
