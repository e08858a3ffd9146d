"""Sampled requests against greedy ones, on loomserve and llama-server, side by side.

Starts one `loomserve serve` and, when its binary is there, llama-server twice: with its
defaults and with `--backend-sampling` (its sampler chains in the graph). Every server has
16 slots and the same threads and model. Each round runs every load against every server,
alternating, so that the shared machine's moods spread over all of them. Loads (closed
loops of `loomserve bench`, random prompts of 50 tokens, 64 tokens out with ignore_eos):

  greedy c=1, c=4, c=16:  temperature 0
  T=1 c=1, c=4, c=16:     temperature 1 and nothing else: loomserve samples the whole
                          distribution (as OpenAI and vLLM do); llama-server adds its own
                          defaults (top-k 40, top-p 0.95, min-p 0.05)
  T=0.7 top_p c=4, c=16:  temperature 0.7, top_p 0.95 (a common client default)

It prints the medians per load and server, loomserve's sampled loads against its greedy load
at the same concurrency, and loomserve against each llama-server.

    python -m benchmarks.bench_sampled --rounds 3
    python -m benchmarks.bench_sampled --rounds 3 --also '--no-batch-invariant --no-spec-ngram'

`--also` adds a loomserve with other options to the rotation: with `--no-batch-invariant`
it runs llama.cpp's kernels and one shared KV cache as llama-server does, which measures the
serving layers alone, without the price of batch invariance (which llama-server does not
offer).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_spec as spec
from benchmarks.bench_spec import free_port, start, stop
from loomserve.cli.default_model import resolve_model

LLAMA_SERVER = Path("/work/llama-server/build/bin/llama-server")
SLOTS = 16
CTX_PER_SLOT = 1024
INPUT_TOKENS = 50  # about 40 words
OUTPUT_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Load:
    name: str
    concurrency: int
    temperature: float
    top_p: float | None = None

    @property
    def greedy_twin(self) -> str:
        return f"greedy c={self.concurrency}"


LOADS = (
    Load("greedy c=1", 1, 0.0),
    Load("T=1 c=1", 1, 1.0),
    Load("greedy c=4", 4, 0.0),
    Load("greedy c=16", 16, 0.0),
    Load("T=1 c=4", 4, 1.0),
    Load("T=1 c=16", 16, 1.0),
    Load("T=0.7 top_p c=4", 4, 0.7, 0.95),
    Load("T=0.7 top_p c=16", 16, 0.7, 0.95),
)


def server_log(server: str, port: int) -> Path:
    """Where the server ("loom" or "llama") on `port` writes its output."""
    return Path(tempfile.gettempdir()) / f"bench-sampled-{server}-{port}.log"


def loomserve(model: Path, port: int, threads: int, extra: list[str]) -> object:
    args = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(model)]
    args += ["--port", str(port), "--slots", str(SLOTS), "--ctx-size", str(CTX_PER_SLOT)]
    args += ["--threads", str(threads), *extra]
    return start(args, port, server_log("loom", port))


def llama_server(model: Path, port: int, threads: int, binary: Path, extra: list[str]) -> object:
    args = [str(binary), "-m", str(model), "--port", str(port), "--host", "127.0.0.1"]
    args += ["-t", str(threads), "-tb", str(threads), "-np", str(SLOTS)]
    args += ["-c", str(SLOTS * CTX_PER_SLOT), "--no-webui", *spec.llama_server_cpu_args(), *extra]
    return start(args, port, server_log("llama", port))


def prompt_seed(round_: int, load: Load) -> int:
    """The seed of a load's prompts in a round: the same on every server (each its own
    process, its own cache), never the same for two loads or rounds. A server keeps what it
    prefilled in its prefix cache, so a load on an earlier load's prompts was timed on cache
    hits: with one seed a round, every sampled load had reused the greedy load's prompts."""
    return round_ * len(LOADS) + LOADS.index(load)


def run_load(base_url: str, load: Load, seed: int) -> float:
    body: dict = {"ignore_eos": True}
    if load.top_p is not None:
        body["top_p"] = load.top_p
    shape = spec.Load(
        load.name,
        "random",
        load.concurrency,
        max(2 * load.concurrency, 6),  # a single stream's run long enough to time
        "completions",
        INPUT_TOKENS,
        OUTPUT_TOKENS,
        load.temperature,
    )
    return spec.run_load(base_url, shape, seed, body)


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--rounds", type=int, default=3)
@click.option("--threads", type=int, default=2)
@click.option("--loads", default=",".join(load.name for load in LOADS), help="Which loads.")
@click.option("--llama-server", "binary", type=click.Path(path_type=Path), default=LLAMA_SERVER)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--also",
    multiple=True,
    help="Another loomserve beside the default one, with these serve options (quoted), e.g. "
    "--also '--no-batch-invariant --no-spec-ngram': llama.cpp's kernels as llama-server runs "
    "them. Repeatable.",
)
def main(
    model: str | None,
    rounds: int,
    threads: int,
    loads: str,
    binary: Path,
    json_out: Path | None,
    also: tuple[str, ...],
) -> None:
    """Alternate the servers on every load, `rounds` times; print medians and ratios."""
    path = resolve_model(model)
    chosen = [load for load in LOADS if load.name in loads.split(",")]
    servers: dict[str, str] = {}
    procs = []
    try:
        for extra in ("", *also):
            port = free_port()
            procs.append(loomserve(path, port, threads, extra.split()))
            servers[f"loomserve {extra}".strip()] = f"http://127.0.0.1:{port}"
        if binary.exists():
            for name, extra in (("llama-server", []), ("llama-server -bs", ["--backend-sampling"])):
                port = free_port()
                procs.append(llama_server(path, port, threads, binary, extra))
                servers[name] = f"http://127.0.0.1:{port}"
        else:
            click.echo(f"no llama-server at {binary}: loomserve only", err=True)
        runs = {load.name: {name: [] for name in servers} for load in chosen}
        for round_ in range(rounds):
            for load in chosen:
                for name, base_url in servers.items():
                    tok_s = run_load(base_url, load, seed=prompt_seed(round_, load))
                    runs[load.name][name].append(tok_s)
                    click.echo(f"round {round_} {load.name} {name}: {tok_s:.1f} tok/s", err=True)
    finally:
        for proc in procs:
            stop(proc)  # type: ignore[arg-type]
    names = list(servers)
    ours = [name for name in names if name.startswith("loomserve")]
    theirs = names[len(ours) :]
    click.echo(f"\n{path.name}, {threads} threads, {SLOTS} slots, medians of {rounds} rounds")
    header = ["load", *(f"{n} tok/s" for n in names), "loomserve / its greedy"]
    header += [f"{mine} / {other}" for mine in ours for other in theirs]
    click.echo(" | ".join(header))
    medians = {
        load.name: {name: statistics.median(runs[load.name][name]) for name in names}
        for load in chosen
    }
    for load in chosen:
        row = medians[load.name]
        greedy = medians.get(load.greedy_twin, {}).get("loomserve")
        cells = [load.name, *(f"{row[n]:.1f}" for n in names)]
        cells.append(f"{row['loomserve'] / greedy:.2f}" if greedy else "-")
        cells += [f"{row[mine] / row[other]:.2f}" for mine in ours for other in theirs]
        click.echo(" | ".join(cells))
    if json_out:
        json_out.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
