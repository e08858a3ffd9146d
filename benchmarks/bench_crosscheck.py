"""`loomserve bench`'s own figures against an independent tally of the same requests.

Starts `loomserve serve` on the default model (Gemma 3 270M; or --model, or --base-url for a
server already running) and runs a few closed loops through a timestamping proxy
(loomserve/cli/bench/tap.py: a process of its own that forwards bytes and stamps every read,
parsed afterwards with h11). For each load it prints request throughput, output tokens/s,
mean TTFT and mean ITL as the bench reports them and as the wire saw them, and whether they
agree within 5 %. Warm-ups run at each load's concurrency, so the run reuses open connections.

    python -m benchmarks.bench_crosscheck --threads 2
    python -m benchmarks.bench_crosscheck --base-url http://127.0.0.1:8080   # llama-server
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_spec import free_port, start, stop
from loomserve.cli.bench.crosscheck import (
    agreements,
    format_agreements,
    generation_exchanges,
    independent_figures,
)
from loomserve.cli.bench.runner import LoadShape
from loomserve.cli.bench.session import BenchConfig, run_session
from loomserve.cli.bench.tap import tapped
from loomserve.cli.default_model import resolve_model

SLOTS = 4
CTX_PER_SLOT = 1024


@dataclass(frozen=True, slots=True)
class Load:
    name: str
    concurrency: int
    prompts: int
    input_len: int = 128
    output_len: int = 64


LOADS = (
    Load("c=1", 1, 8),
    Load("c=4", 4, 16),
    Load("c=16 (queued behind 4 slots)", 16, 32),
)


def loomserve(model: Path, port: int, threads: int) -> object:
    args = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(model)]
    args += ["--port", str(port), "--slots", str(SLOTS), "--ctx-size", str(CTX_PER_SLOT)]
    args += ["--threads", str(threads)]
    return start(args, port, Path(tempfile.gettempdir()) / f"bench-crosscheck-{port}.log")


def check(base_url: str, load: Load, seed: int) -> list[dict]:
    """One load through the proxy: each figure from the bench and from the wire."""
    with tapped(base_url) as tap:
        config = BenchConfig(
            base_url=tap.url,
            num_prompts=load.prompts,
            input_len=load.input_len,
            output_len=load.output_len,
            shape=LoadShape(max_concurrency=load.concurrency),
            num_warmups=load.concurrency,
            seed=seed,
            duration_s=600.0,
            progress=False,
            save_detailed=True,
            scrape_metrics=False,
        )
        warnings: list[str] = []
        result = run_session(config, echo=lambda *a, **k: None, warn=warnings.append)
    ids = [r["request_id"] for r in result["requests"]]
    figures = independent_figures(generation_exchanges(tap.exchanges(), ids))
    rows = agreements(result["summary"], figures)
    click.echo(
        f"\n{load.name}: {load.prompts} requests, {load.input_len} in, {load.output_len} out"
    )
    click.echo(format_agreements(rows))
    for warning in warnings:  # a stalled client loop shows here, and in the difference
        click.echo(f"  bench warned: {warning}")
    return [asdict(row) | {"difference": row.difference, "agrees": row.agrees} for row in rows]


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--base-url", default=None, help="Check a server already running instead.")
@click.option("--threads", type=int, default=2)
@click.option("--seed", type=int, default=0)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(
    model: str | None, base_url: str | None, threads: int, seed: int, json_out: Path | None
) -> None:
    """Run each load once through the proxy and print both sides' figures."""
    proc = None
    try:
        if base_url is None:
            path = resolve_model(model)
            port = free_port()
            proc = loomserve(path, port, threads)
            base_url = f"http://127.0.0.1:{port}"
            click.echo(f"loomserve serve on {path.name}: {SLOTS} slots, {threads} threads")
        results = {load.name: check(base_url, load, seed) for load in LOADS}
    finally:
        if proc is not None:
            stop(proc)  # type: ignore[arg-type]
    worst = max(abs(row["difference"]) for rows in results.values() for row in rows)
    click.echo(f"\nlargest difference: {worst:.2%}")
    if json_out:
        json_out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
