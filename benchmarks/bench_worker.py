"""How much of the engine's speed the worker's tick loop keeps, and how batching scales.

For 1, 4 and 16 concurrent sequences, each with a short prompt and a fixed number of new
tokens, it times
  (a) the engine alone: one llama_decode per step over all sequences plus a greedy argmax
      per sequence, in the tightest loop Python allows (one reused llama_batch), and
  (b) the worker's tick loop, in-process, on the same engine: N requests with ignore_eos
      and the same max_tokens, submitted at once and run to their Finish,
and prints total tokens per second, the ratio (b)/(a) and the N-vs-1 scaling, as medians
over several alternating runs. Not a test: the machine is shared, so read the numbers.

    python -m benchmarks.bench_worker                  # the default model, Gemma 3 270M
    python -m benchmarks.bench_worker --model x.gguf --runs 7 --tokens 128
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomserve.cli.default_model import resolve_model
from loomserve.cli.logs import configure_logging
from loomserve.gateway.text.tokenizer import Vocab
from loomserve.protocol import Generate, Message, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.tick.loop import TickLoop

BATCH_SIZES = (1, 4, 16)
PROMPT = "Once upon a time, in a small village by the river, there lived"


class NullSink:
    """The worker's output goes nowhere: we time the loop, not a consumer."""

    def send(self, gateway: bytes, message: Message) -> None:
        pass

    def flush(self) -> None:
        pass


def engine_alone(engine: Engine, prompt: list[int], n_seqs: int, n_tokens: int) -> float:
    """Seconds for (a): prefill every sequence in one batch, then n_tokens decode steps."""
    engine.clear_cache()
    batch = engine.batch
    started = time.perf_counter()
    batch.clear()
    for seq in range(n_seqs):
        batch.add_run(prompt, 0, seq, True)
    pos = len(prompt)
    for step in range(n_tokens):
        if engine.decode(batch) != 0:
            raise RuntimeError("llama_decode failed")
        # Every sequence asked for logits at one token, so row seq is sequence seq's.
        tokens = engine.output_logits(n_seqs).argmax(axis=1).tolist()
        if step == n_tokens - 1:
            break
        batch.clear()
        for seq in range(n_seqs):
            batch.add(tokens[seq], pos, seq, True)
        pos += 1
    return time.perf_counter() - started


def worker_loop(engine: Engine, prompt: list[int], n_seqs: int, n_tokens: int) -> float:
    """Seconds for (b): n_seqs requests through the tick loop, from submit to Finish."""
    loop = TickLoop(engine, engine.config, NullSink())
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for i in range(n_seqs):
        loop.inbox.submit(b"bench", Generate(f"r{i}", prompt, params))
    loop.tick()
    while loop.scheduler.has_work():
        loop.tick()
    return time.perf_counter() - started


@click.command()
@click.option("--model", default=None, help="GGUF model; default: Gemma 3 270M.")
@click.option("--runs", default=5, show_default=True, help="Timed runs per case (median).")
@click.option("--tokens", default=64, show_default=True, help="New tokens per sequence.")
@click.option("--threads", default=0, show_default=True, help="llama.cpp threads; 0: all.")
@click.option(
    "--flash-attn", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True
)
@click.option("--batch-invariant/--no-batch-invariant", default=True, show_default=True)
@click.option(
    "--sizes",
    default=",".join(map(str, BATCH_SIZES)),
    show_default=True,
    help="Comma-separated numbers of concurrent sequences; the first is the scaling baseline.",
)
@click.option(
    "--spec-ngram/--no-spec-ngram",
    default=None,
    help="The worker's n-gram drafting; default: the worker's (on without batch invariance).",
)
def main(
    model: str | None,
    runs: int,
    tokens: int,
    threads: int,
    flash_attn: str,
    batch_invariant: bool,
    sizes: str,
    spec_ngram: bool | None,
) -> None:
    """Engine alone vs the worker's tick loop at 1, 4 and 16 concurrent sequences."""
    configure_logging(level="warning")
    batch_sizes = tuple(int(size) for size in sizes.split(","))
    config = WorkerConfig(
        model_path=resolve_model(model),
        slots=max(batch_sizes),
        ctx_size=512,
        batch_tokens=512,
        threads=threads,
        flash_attn=flash_attn,
        batch_invariant=batch_invariant,
        spec_ngram=spec_ngram,
    )
    engine = Engine(config)
    # Every prompt is prefilled in one batch in both paths: keep them within the budget.
    vocab = Vocab(config.model_path)
    prompt = vocab.tokenize(PROMPT, add_special=True, parse_special=False)
    prompt = prompt[: config.batch_tokens // max(batch_sizes)]
    print(
        f"model {engine.description.description} ({engine.description.name}), "
        f"{config.n_threads} threads, {engine.description.runs_on}, "
        f"prompt {len(prompt)} tokens, {tokens} new tokens per sequence, {runs} runs"
    )
    # Warm up both paths once: first-touch allocations and caches are not what we measure.
    engine_alone(engine, prompt, max(batch_sizes), 4)
    worker_loop(engine, prompt, max(batch_sizes), 4)

    rates: dict[tuple[str, int], float] = {}
    for n_seqs in batch_sizes:
        alone, looped = [], []
        for _ in range(runs):  # alternate, so drift in the machine's load hits both alike
            alone.append(engine_alone(engine, prompt, n_seqs, tokens))
            looped.append(worker_loop(engine, prompt, n_seqs, tokens))
        total = n_seqs * tokens
        rates["engine", n_seqs] = total / statistics.median(alone)
        rates["worker", n_seqs] = total / statistics.median(looped)

    print(f"\n{'sequences':>9} {'engine tok/s':>13} {'worker tok/s':>13} {'worker/engine':>14}")
    for n_seqs in batch_sizes:
        a, b = rates["engine", n_seqs], rates["worker", n_seqs]
        print(f"{n_seqs:>9} {a:>13.1f} {b:>13.1f} {b / a:>14.3f}")
    top = max(batch_sizes)
    for who in ("engine", "worker"):
        scaling = rates[who, top] / rates[who, batch_sizes[0]]
        print(f"{who}: {top} sequences give {scaling:.2f}x the tokens/s of {batch_sizes[0]}")
    engine.close()


if __name__ == "__main__":
    main()
