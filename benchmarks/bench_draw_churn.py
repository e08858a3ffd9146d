"""What `--backend-sampling draw` gains on a queue of requests, in process, and what a mixed
load costs it. Not a test: read the numbers.

    python -m benchmarks.bench_draw_churn            # Gemma 3 270M, 16 slots, 3 rounds

A queue of requests (temperature 1, seeded) drains through the slots, host sampling
(`off`) and the draw inside llama_decode (`draw`) alternating, each on its own engine:
- all drawn: every request is one the draw serves;
- mixed: every other request asks for logprobs, which the host samples. A slot that passes
  from one kind to the other has its sampler attached or detached, and llama.cpp plans its
  graph again each time (graph_draw.py), so this is the load that churn costs most.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

import click
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_sampling import Nowhere, prompts
from loomserve.cli.default_model import resolve_model
from loomserve.protocol import Generate, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.tick.loop import TickLoop

MODES = ("off", "draw")


def drain_seconds(engine: Engine, config: WorkerConfig, n: int, tokens: int, mixed: bool) -> float:
    """Seconds to run n requests of `tokens` tokens each, all queued at once."""
    loop = TickLoop(engine, config, Nowhere())
    for i, prompt in enumerate(prompts(engine, n, 16)):
        extra = {"logprobs": 1} if mixed and i % 2 else {}
        params = SamplingParams(
            max_tokens=tokens, ignore_eos=True, seed=i, temperature=1.0, **extra
        )
        loop.inbox.submit(b"bench", Generate(f"r{i}", prompt, params))
    started = time.perf_counter()
    for ticks in range(100_000):
        if ticks >= 3 and not loop.scheduler.has_work():
            break
        loop.tick(block=False)
    loop.sampling_threads.close()
    return time.perf_counter() - started


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--slots", type=int, default=16)
@click.option("--requests", "n", type=int, default=64)
@click.option("--tokens", type=int, default=24, help="Tokens out per request.")
@click.option("--rounds", type=int, default=3)
@click.option("--threads", type=int, default=2)
def main(model: str | None, slots: int, n: int, tokens: int, rounds: int, threads: int) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    engines = {}
    for mode in MODES:
        config = WorkerConfig(
            model_path=resolve_model(model),
            slots=slots,
            ctx_size=256,
            threads=threads,
            batch_tokens=512,
            max_queue=n,
            backend_sampling=mode,
        )
        engines[mode] = (Engine(config), config)
    seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for load in ("all drawn", "mixed"):
            for mode in MODES:
                engine, config = engines[mode]
                took = drain_seconds(engine, config, n, tokens, load == "mixed")
                seconds.setdefault((load, mode), []).append(took)
    print(f"{n} requests of {tokens} tokens through {slots} slots, medians of {rounds} (s)")
    for load in ("all drawn", "mixed"):
        host, drawn = (statistics.median(seconds[load, mode]) for mode in MODES)
        print(f"{load:10} host {host:6.2f}  draw {drawn:6.2f}  draw / host {drawn / host:.3f}")
    for engine, _ in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
