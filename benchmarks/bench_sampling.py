"""What sampling costs on the host, in process, on the real model's logits. Not a test: read
the numbers.

    python -m benchmarks.bench_sampling                     # Gemma 3 270M (262,144 tokens)
    python -m benchmarks.bench_sampling --slots 64 --reps 5

Two figures:
- per token: one token sampled from one row of logits, by llama.cpp's sampler chain (what
  loomserve ran before, and what grammar requests still run) and by the host sampler
  (worker/sampling/draw.py) as a tick draws them on one thread (sample_rows: the sampled rows
  in one call into C), for each mix of settings; the rows are those of one forward pass over
  `--slots` different prompts, as a tick's are: at the ends of prompts of random words (as
  the HTTP benchmarks send), after each has generated GENERATED tokens from them, and at
  the ends of prompts cut from prose (real text: mostly peaked rows).
- per tick: a TickLoop with `--slots` generating slots, every tick's time outside
  llama_decode (scheduling, the batch, sampling, bookkeeping, outputs) and in it, greedy
  against each sampled mix, with the host sampler, with the host's C draw inside llama_decode
  (worker/sampling/graph_draw.py) and with llama.cpp's chains there
  (worker/sampling/backend_sampling.py).
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import click
import llama_cpp as llama
import numpy as np
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomserve.cli.default_model import resolve_model
from loomserve.protocol import Generate, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.sampling.backend_sampling import drawing_stages, sampler_chain
from loomserve.worker.sampling.samplers import (
    MAX_SAMPLING_THREADS,
    HostSampler,
    sample_rows,
)
from loomserve.worker.tick.loop import TickLoop

MIXES: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top_p 0.95": {"temperature": 0.7, "top_p": 0.95},
    "top_k 40, top_p 0.95, min_p 0.05, T 0.8": {
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
    },
    "min_p 0.1, T 1.0": {"temperature": 1.0, "min_p": 0.1},
    "top_k 50, T 1.2": {"temperature": 1.2, "top_k": 50},
    # Written into the row for the tick and put back (sample_rows), not a copy of it.
    "presence_penalty 0.5, T 1": {"temperature": 1.0, "presence_penalty": 0.5},
    "logit_bias x 10, T 1": {"temperature": 1.0, "logit_bias": {t: -2.0 for t in range(10)}},
}
# The second per-token table's rows: after this many tokens generated from each prompt.
GENERATED = 24
# Untimed draws over the rows before the timed one. Right after llama.cpp's chain (or 1 s
# idle) the draws ran 2-3x slower for a few calls, whatever the rows, and came down call by
# call (temperature 1, 64 rows, us a row: 141, 97, 74, 58, 51, 50, 50): the core's clock or
# its AVX-512 state ramping up. A tick's draws follow llama_decode's own AVX-512 work, so the
# steady state is what a tick sees; the greedy argmax, bound by its read, showed no ramp.
WARM_UP = 6
WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this "
    "be or has had not but it first one their its new after who they two have been also"
).split()


class Nowhere:
    """A Sink that drops what the loop says."""

    def send(self, gateway: bytes, message) -> None:
        pass

    def flush(self) -> None:
        pass


def prose(engine: Engine, n: int, length: int) -> list[list[int]]:
    """n different prompts of `length` tokens cut from docs/sampling.md's prose: a model reads
    on in real text far more surely than after random words (its rows are more peaked)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "sampling.md").read_text()
    tokens = engine_tokens(engine, " ".join(text.split()))
    step = max(1, (len(tokens) - length) // n)
    return [tokens[i * step : i * step + length] for i in range(n)]


def prompts(engine: Engine, n: int, length: int) -> list[list[int]]:
    """n different prompts of about `length` tokens, from common words."""
    out = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * (i + 3)) % len(WORDS)] for j in range(length)]
        out.append(engine_tokens(engine, " ".join(words))[:length])
    return out


def engine_tokens(engine: Engine, text: str) -> list[int]:
    import llama_cpp as llama

    raw = text.encode()
    buffer = (llama.llama_token * (len(raw) + 8))()
    n = llama.llama_tokenize(engine.vocab, raw, len(raw), buffer, len(buffer), True, False)
    return list(buffer[:n])


def rows(
    engine: Engine, slots: int, generated: int, text: bool = False
) -> tuple[list[int], np.ndarray]:
    """One pass's rows of logits over `slots` different prompts (random words, or cut from
    prose with `text`): at the prompts' ends (generated 0), or after each has generated that
    many tokens (temperature 0.7, top_p 0.95, as a load would). Returns their batch indices
    in the last pass, and them."""
    batch = engine.batch
    engine.clear_cache()
    batch.clear()
    texts = (prose if text else prompts)(engine, slots, 24)
    indices = [
        batch.add_run(prompt, 0, seq, logits_on_last=True) for seq, prompt in enumerate(texts)
    ]
    params = SamplingParams(max_tokens=generated + 1, temperature=0.7, top_p=0.95)
    samplers = [HostSampler(replace(params, seed=seq), 4096) for seq in range(slots)]
    for step in range(generated + 1):
        if engine.decode(batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = engine.output_logits(slots)
        if step == generated:
            return indices, logits
        tokens = [samplers[seq].sample(indices[seq], logits[seq]) for seq in range(slots)]
        batch.clear()
        indices = [
            batch.add(token, len(texts[seq]) + step, seq, True) for seq, token in enumerate(tokens)
        ]
    raise AssertionError("unreachable")


def per_token(
    engine: Engine, indices: list[int], logits: np.ndarray, reps: int
) -> dict[str, tuple[float, float]]:
    """Median microseconds per sampled token: (llama.cpp chain, host sampler), per mix, over
    the rows of the last pass (`indices` in it, `logits` copied from it). The host sampler
    draws the rows as a tick does on one thread (sample_rows: greedy rows' argmax, the
    sampled rows in one call into C), each row with its own sampler, after WARM_UP untimed
    draws (the first also gives each its hint of the row's mass)."""
    slots = len(indices)
    results = {}
    for name, fields in MIXES.items():
        params = SamplingParams(max_tokens=16, **fields)
        timings: dict[str, list[float]] = {"chain": [], "host": []}
        for rep in range(reps):
            # llama.cpp's own chain over each row (llama_sampler_sample reads the context's).
            chain = sampler_chain(drawing_stages(params, engine.n_vocab))
            started = time.perf_counter()
            for index in indices:
                llama.llama_sampler_sample(chain, engine.ctx, index)
            timings["chain"].append((time.perf_counter() - started) / slots * 1e6)
            llama.llama_sampler_free(chain)
            host = [
                HostSampler(replace(params, seed=rep * slots + row), 4096) for row in range(slots)
            ]
            for _ in range(WARM_UP):
                sample_rows(host, indices, logits)
            started = time.perf_counter()
            sample_rows(host, indices, logits)
            timings["host"].append((time.perf_counter() - started) / slots * 1e6)
        results[name] = (statistics.median(timings["chain"]), statistics.median(timings["host"]))
    return results


def per_tick(engine: Engine, config: WorkerConfig, fields: dict, ticks: int) -> tuple[float, float]:
    """Median milliseconds per tick (outside llama_decode, in it), every slot generating."""
    loop = TickLoop(engine, config, Nowhere())
    decode_seconds = [0.0]
    decode = engine.decode

    def timed_decode(batch):
        started = time.perf_counter()
        try:
            return decode(batch)
        finally:
            decode_seconds[0] += time.perf_counter() - started

    engine.decode = timed_decode  # type: ignore[method-assign]
    try:
        for i, prompt in enumerate(prompts(engine, config.slots, 16)):
            params = SamplingParams(max_tokens=ticks + 64, ignore_eos=True, seed=i, **fields)
            loop.inbox.submit(b"bench", Generate(f"r{i}", prompt, params))
        while any(slot.prompt_remaining for slot in loop.scheduler.slots) or loop.tick_count < 3:
            loop.tick(block=False)
        host, in_decode = [], []
        for _ in range(ticks):
            decode_seconds[0] = 0.0
            started = time.perf_counter()
            loop.tick(block=False)
            host.append(time.perf_counter() - started - decode_seconds[0])
            in_decode.append(decode_seconds[0])
        loop.scheduler.cancel_all("done")
        loop.tick(block=False)
    finally:
        engine.decode = decode  # type: ignore[method-assign]
        loop.sampling_threads.close()
    return statistics.median(host) * 1000, statistics.median(in_decode) * 1000


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--threads", type=int, default=2)
@click.option("--slots", type=int, default=64, help="Rows per tick, and slots of the loop.")
@click.option("--reps", type=int, default=5, help="Runs per per-token figure (median shown).")
@click.option("--ticks", type=int, default=20, help="Ticks per per-tick figure (median).")
@click.option(
    "--sampling-threads",
    default="",
    help="Also the host sampler's time per tick with each of these numbers of sampling "
    f"threads, comma-separated (the worker's: --threads, at most {MAX_SAMPLING_THREADS}).",
)
def main(
    model: str | None, threads: int, slots: int, reps: int, ticks: int, sampling_threads: str
) -> None:
    # The loop logs every finish; only the figures belong on the screen.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    config = WorkerConfig(
        model_path=resolve_model(model),
        slots=slots,
        ctx_size=256,
        threads=threads,
        batch_tokens=max(512, slots * 24),  # every prompt in one pass
        max_queue=slots,
        backend_sampling="off",  # the host sampler, even where auto would pick the graph
    )
    engine = Engine(config)
    print(f"model {config.model_path.name}, vocabulary {engine.n_vocab}, {slots} rows")
    for text, generated in ((False, 0), (False, GENERATED), (True, 0)):
        where = "prose prompts' ends" if text else "random words' ends"
        where += f", {generated} tokens on" if generated else ""
        print(f"\nper token, {where}: median of {reps} runs over {slots} rows (microseconds)")
        print(f"{'settings':42} {'llama.cpp chain':>16} {'host sampler':>13} {'speed-up':>9}")
        indices, logits = rows(engine, slots, generated, text)
        for name, (chain, host) in per_token(engine, indices, logits, reps).items():
            print(f"{name:42} {chain:16.1f} {host:13.1f} {chain / host:8.1f}x")
    engine.clear_cache()
    print(f"\nper tick at {slots} generating slots (ms, median of {ticks})")
    print("  host: sampled on the host after llama_decode (llama.cpp copies the logits out)")
    print("  draw: --backend-sampling draw, the host's C draw inside llama_decode, no copy")
    print("  chains: --backend-sampling on, llama.cpp's sampler chains inside llama_decode")
    places = ("host", "draw", "chains")
    print(f"{'':42} " + " ".join(f"{place:>21}" for place in places))
    print(f"{'settings':42} " + " ".join(f"{'outside':>10} {'in decode':>10}" for _ in places))
    engines = {"host": (engine, config)}
    for place, mode in (("draw", "draw"), ("chains", "on")):
        other = replace(config, backend_sampling=mode)
        engines[place] = (Engine(other), other)
    for name, fields in MIXES.items():
        figures = [per_tick(e, c, fields, ticks) for e, c in engines.values()]
        print(f"{name:42} " + " ".join(f"{out:10.2f} {inside:10.2f}" for out, inside in figures))
    for place in ("draw", "chains"):
        engines[place][0].close()
    for n in [int(part) for part in sampling_threads.split(",") if part]:
        print(f"\nper tick, host sampler, {n} sampling threads (ms outside llama_decode)")
        for name, fields in MIXES.items():
            with_n = replace(config, sampling_threads=n)
            print(f"{name:42} {per_tick(engine, with_n, fields, ticks)[0]:17.2f}")
    engine.close()


if __name__ == "__main__":
    main()
