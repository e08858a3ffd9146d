"""What speculation can gain on this engine: the cost of a tick with n rows of one sequence,
with logits at every row (a token and its n-1 drafts, all verified) and at the last only (a
prompt chunk), against one decode token. Not a test: read the numbers.

    python -m benchmarks.bench_draft_rows                    # Gemma 3 270M, batch invariant
    python -m benchmarks.bench_draft_rows --no-batch-invariant --threads 2

A draft of L tokens accepted whole turns one tick of `rows 1` into one of `rows L+1` that
yields L+1 tokens: the best speculation can do for one stream is max over L of
(L+1) * t(1) / t(L+1), and only with every draft accepted.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomserve.cli.default_model import resolve_model
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine

CONTEXT_TOKENS = 300  # a prompt the drafts follow, as an input-grounded request's


def tick_ms(engine: Engine, tokens: list[int], rows: int, all_logits: bool, reps: int) -> float:
    """Median milliseconds of one llama_decode of `rows` tokens after the context, and reading
    their logits' argmax; the rows' cells are dropped after each run."""
    batch, times = engine.batch, []
    for _ in range(reps):
        batch.clear()
        for j in range(rows):
            batch.add(tokens[j], CONTEXT_TOKENS + j, 0, all_logits or j == rows - 1)
        started = time.perf_counter()
        if engine.decode(batch) != 0:
            raise RuntimeError("llama_decode failed")
        engine.output_logits(rows if all_logits else 1).argmax(axis=1)
        times.append(time.perf_counter() - started)
        engine.keep_prefix(0, CONTEXT_TOKENS)
    return statistics.median(times) * 1000


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--threads", type=int, default=2)
@click.option("--batch-invariant/--no-batch-invariant", default=True)
@click.option("--reps", type=int, default=9, help="Runs per figure (the median is shown).")
def main(model: str | None, threads: int, batch_invariant: bool, reps: int) -> None:
    config = WorkerConfig(
        model_path=resolve_model(model),
        slots=1,
        ctx_size=2048,
        threads=threads,
        batch_invariant=batch_invariant,
    )
    engine = Engine(config)
    rng = random.Random(0)
    tokens = [rng.randrange(100, min(20000, engine.n_vocab)) for _ in range(CONTEXT_TOKENS)]
    batch = engine.batch
    batch.clear()
    for position, token in enumerate(tokens):
        batch.add(token, position, 0, False)
    engine.decode(batch)
    one = tick_ms(engine, tokens, 1, True, reps)
    click.echo(f"{config.model_path.name}, {threads} threads, batch invariant: {batch_invariant}")
    click.echo("rows | ms, logits at every row | ms, logits at the last | ceiling (rows·t1/t)")
    best = 0.0
    for rows in (1, 2, 4, 8, 12, 17):
        every = tick_ms(engine, tokens, rows, True, reps)
        last = tick_ms(engine, tokens, rows, False, reps)
        ceiling = rows * one / every
        best = max(best, ceiling)
        click.echo(f"{rows} | {every:.1f} | {last:.1f} | {ceiling:.2f}x")
    click.echo(f"speculation's ceiling for one stream, every draft accepted: {best:.2f}x")
    engine.close()


if __name__ == "__main__":
    main()
