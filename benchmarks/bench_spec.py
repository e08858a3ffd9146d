"""Self-speculative n-gram decoding: output tokens/s with drafts and without, side by side.

Starts one `loomserve serve --spec-ngram` and, when its binary is there, one
llama-server with `--spec-type ngram-simple` on the same model and threads. Each round runs
every load against: loomserve with `"speculative": false` in every request (no drafts: the
plain tick), loomserve as it is, and llama-server; the rounds alternate them so that the
shared machine's moods spread over all three. Loads (`loomserve bench`, closed loops):

  grounded c=1, c=4: the input-grounded dataset (a passage of ~200 tokens asked back, edited;
                     chat endpoint, greedy), the load speculation is for;
  random c=4, c=16:  random prompts (128 tokens in, 64 out), greedy: a small base model's
                     output often loops, and drafts from the loop pass;
  sampled c=16:      the same at temperature 1, where a draft passes only when the
                     sampled token equals it.

It prints the medians per load and server and the ratios to loomserve without drafts.

    python -m benchmarks.bench_spec --rounds 3
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomserve.cli.bench.runner import LoadShape
from loomserve.cli.bench.session import BenchConfig, run_session
from loomserve.cli.default_model import resolve_model

LLAMA_SERVER = Path("/work/llama-server/build/bin/llama-server")
SLOTS = 16
CTX_PER_SLOT = 2048


@dataclass(frozen=True, slots=True)
class Load:
    name: str
    dataset: str
    concurrency: int
    prompts: int
    endpoint: str
    input_len: int
    output_len: int | None  # None: the dataset's own (the passage's length)
    temperature: float = 0.0


RUNS_PER_SERVER = 2  # loomserve serves a load twice a round: drafts off, then on
LOADS = (
    Load("grounded c=1", "input-grounded", 1, 4, "chat", 200, None),
    Load("grounded c=4", "input-grounded", 4, 8, "chat", 200, None),
    Load("random c=4", "random", 4, 8, "completions", 128, 64),
    Load("random c=16", "random", 16, 16, "completions", 128, 64),
    # Sampled at temperature 1: a draft passes only when the sampled token equals it.
    Load("sampled c=16", "random", 16, 16, "completions", 128, 64, temperature=1.0),
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args: list[str], port: int, log: Path, own_session: bool = True) -> subprocess.Popen:
    """The server, healthy, in a process group of its own (stop ends it whole): in a session
    of its own too unless own_session is False (Linux's autogroup shares the CPUs among
    sessions first)."""
    group = {"start_new_session": True} if own_session else {"process_group": 0}
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, **group)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{args[0]} exited; see {log}")
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{args[0]} did not become healthy; see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def loomserve(model: Path, port: int, threads: int, extra: list[str]) -> subprocess.Popen:
    args = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(model)]
    args += ["--port", str(port), "--slots", str(SLOTS), "--ctx-size", str(CTX_PER_SLOT)]
    args += ["--threads", str(threads), *extra]
    return start(args, port, Path(tempfile.gettempdir()) / f"bench-spec-loom-{port}.log")


def llama_server_cpu_args() -> list[str]:
    """What llama-server needs on this CPU: where llama.cpp is built with its AMX kernels
    (built here for a CPU with AMX), they crash on a Q4_K_M model's repacked weights
    (llama.cpp #20824), so no repacking (`--no-repack`), as loomserve's engine does itself."""
    from loomserve.worker.engine.engine import amx_kernels  # loads llama.cpp: only when asked

    return ["--no-repack"] if amx_kernels() else []


def llama_server(model: Path, port: int, threads: int, binary: Path) -> subprocess.Popen:
    args = [str(binary), "-m", str(model), "--port", str(port), "--host", "127.0.0.1"]
    args += ["-t", str(threads), "-tb", str(threads), "-np", str(SLOTS)]
    args += ["-c", str(SLOTS * CTX_PER_SLOT), "--spec-type", "ngram-simple", "--no-webui"]
    args += llama_server_cpu_args()
    return start(args, port, Path(tempfile.gettempdir()) / f"bench-spec-llama-{port}.log")


def prompt_seed(round_: int, load: Load, run_on_server: int) -> int:
    """The seed of one run's prompts: never the same for two runs on one server. A server
    keeps what it prefilled in its prefix cache, so a second run on the same prompts (drafts
    on, after drafts off) was timed on cache hits and skipped its prefill."""
    return (round_ * len(LOADS) + LOADS.index(load)) * RUNS_PER_SERVER + run_on_server


def run_load(base_url: str, load: Load, seed: int, extra_body: dict | None) -> float:
    config = BenchConfig(
        base_url=base_url,
        endpoint=load.endpoint,
        dataset=load.dataset,
        input_len=load.input_len,
        output_len=load.output_len,
        num_prompts=load.prompts,
        shape=LoadShape(max_concurrency=load.concurrency),
        seed=seed,
        temperature=load.temperature,
        extra_body=extra_body,
        progress=False,
        num_warmups=0,
        duration_s=600.0,
        # llama-server serves no /metrics without --metrics, so only loomserve would be
        # scraped (every second, by this process): the servers are compared unscraped.
        scrape_metrics=False,
    )
    result = run_session(config, echo=lambda *a, **k: None, warn=lambda *a: None)
    return result["summary"]["output_throughput"]


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--rounds", type=int, default=3)
@click.option("--threads", type=int, default=2)
@click.option("--loads", default=",".join(load.name for load in LOADS), help="Which loads.")
@click.option("--llama-server", "binary", type=click.Path(path_type=Path), default=LLAMA_SERVER)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--loomserve-args",
    default="",
    help='More `loomserve serve` options, e.g. "--no-batch-invariant".',
)
def main(
    model: str | None,
    rounds: int,
    threads: int,
    loads: str,
    binary: Path,
    json_out: Path | None,
    loomserve_args: str,
) -> None:
    """Alternate the servers on every load, `rounds` times; print medians and ratios."""
    path = resolve_model(model)
    chosen = [load for load in LOADS if load.name in loads.split(",")]
    servers: dict[str, tuple[str, dict | None, int]] = {}
    procs = []
    try:
        port = free_port()
        procs.append(loomserve(path, port, threads, ["--spec-ngram", *shlex.split(loomserve_args)]))
        url = f"http://127.0.0.1:{port}"
        # The two loomserve runs share one server, so each has prompts of its own; llama-server
        # (its own process) gets the prompts of loomserve's run with drafts.
        servers["loomserve, no drafts"] = (url, {"speculative": False}, 0)
        servers["loomserve"] = (url, None, 1)
        if binary.exists():
            port = free_port()
            procs.append(llama_server(path, port, threads, binary))
            servers["llama-server ngram-simple"] = (f"http://127.0.0.1:{port}", None, 1)
        else:
            click.echo(f"no llama-server at {binary}: loomserve only", err=True)
        runs: dict[str, dict[str, list[float]]] = {
            load.name: {name: [] for name in servers} for load in chosen
        }
        for round_ in range(rounds):
            for load in chosen:
                for name, (base_url, body, run_on_server) in servers.items():
                    seed = prompt_seed(round_, load, run_on_server)
                    tok_s = run_load(base_url, load, seed=seed, extra_body=body)
                    runs[load.name][name].append(tok_s)
                    click.echo(f"round {round_} {load.name} {name}: {tok_s:.1f} tok/s", err=True)
    finally:
        for proc in procs:
            stop(proc)
    click.echo(
        f"\n{path.name}, {threads} threads, {SLOTS} slots, medians of {rounds}"
        + (f", loomserve {loomserve_args}" if loomserve_args else "")
    )
    names = list(servers)
    click.echo(
        "load | "
        + " | ".join(f"{n} tok/s" for n in names)
        + " | "
        + " | ".join(f"{n} / no drafts" for n in names[1:])
    )
    medians = {}
    for load in chosen:
        row = {name: statistics.median(runs[load.name][name]) for name in names}
        medians[load.name] = row
        base = row[names[0]]
        click.echo(
            f"{load.name} | "
            + " | ".join(f"{row[n]:.1f}" for n in names)
            + " | "
            + " | ".join(f"{row[n] / base:.2f}" for n in names[1:])
        )
    if json_out:
        json_out.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
