"""One worker with 2 threads against two workers with 1 thread each, behind one gateway.

Each set-up runs under `loomserve serve` (one gateway; the same total slots: 8 in one worker,
or 4 in each of two) and takes the same load from `loomserve bench`; the rounds alternate so
the machine's noise falls on all alike. It prints output tokens/s, TTFT and TPOT medians,
their ratios, and how the gateway spread the requests over the workers. A third set-up, one
worker with 1 thread, separates what threading does from what routing does.

On a CPU this is a check of routing's correctness and overhead, not a speed-up: the two
workers share the same cores and memory bandwidth that the one worker used alone.

    python -m benchmarks.bench_replicas                       # the default model
    python -m benchmarks.bench_replicas --model x.gguf --rounds 3 --num-prompts 32
"""

from __future__ import annotations

import json
import os
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

from loomserve.cli.default_model import resolve_model


@dataclass(frozen=True, slots=True)
class SetUp:
    """One way to spend the machine: workers × threads, with the same total slots."""

    name: str
    workers: int
    threads: int
    slots: int  # per worker


SETUPS = (
    SetUp("1 worker x 2 threads", 1, 2, 8),
    SetUp("2 workers x 1 thread", 2, 1, 4),
    SetUp("1 worker x 1 thread", 1, 1, 8),
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(model: Path, setup: SetUp, port: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(model)]
    argv += ["--port", str(port), "--workers", str(setup.workers), "--threads", str(setup.threads)]
    argv += ["--slots", str(setup.slots), "--ctx-size", "1024", "--log-json"]
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(url: str, workers: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            body = httpx.get(url + "/health", timeout=2).json()
            if body.get("workers_ready") == workers:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not get {workers} workers ready in {timeout:.0f} s")


def bench(url: str, result: Path, options: dict[str, str]) -> dict:
    argv = [sys.executable, "-m", "loomserve.cli.main", "bench", "--base-url", url]
    for key, value in options.items():
        argv += [f"--{key}", value]
    argv += ["--result-json", str(result), "--no-progress"]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())["summary"]


def routed(url: str) -> dict[str, float]:
    """Requests the gateway sent to each worker, by worker."""
    counts: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("loomserve:worker_requests_routed_total{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            counts[worker] = float(line.rsplit(" ", 1)[1])
    return counts


@click.command()
@click.option("--model", default=None, help="GGUF model; default: Gemma 3 270M.")
@click.option("--rounds", type=int, default=3, help="Alternating rounds per set-up.")
@click.option("--num-prompts", type=int, default=32, help="Requests per run.")
@click.option("--max-concurrency", type=int, default=8, help="Requests in flight at once.")
@click.option("--input-len", type=int, default=128, help="Prompt tokens.")
@click.option("--output-len", type=int, default=64, help="Tokens generated per request.")
def main(
    model: str | None,
    rounds: int,
    num_prompts: int,
    max_concurrency: int,
    input_len: int,
    output_len: int,
) -> None:
    """Run the comparison and print a table (medians over the rounds)."""
    model_path = resolve_model(model)
    load = {
        "dataset": "random",
        "input-len": str(input_len),
        "output-len": str(output_len),
        "num-prompts": str(num_prompts),
        "max-concurrency": str(max_concurrency),
        "num-warmups": "2",
    }
    workdir = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    results: dict[str, list[dict]] = {setup.name: [] for setup in SETUPS}
    spread: dict[str, list[list[float]]] = {setup.name: [] for setup in SETUPS}
    for round_index in range(rounds):
        for setup in SETUPS if round_index % 2 == 0 else reversed(SETUPS):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            process = serve(model_path, setup, port, workdir / "serve.log")
            try:
                wait_ready(url, setup.workers)
                summary = bench(url, workdir / f"{round_index}-{setup.workers}.json", load)
                results[setup.name].append(summary)
                spread[setup.name].append(sorted(routed(url).values()))
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(60)
            print(
                f"round {round_index + 1} {setup.name}: "
                f"{summary['output_throughput']:.1f} tok/s, "
                f"failed {summary['failed']}, routed {spread[setup.name][-1]}",
                flush=True,
            )

    def median(name: str, key: str) -> float:
        return statistics.median(summary[key] for summary in results[name])

    print(f"\nmodel {model_path.name}, {os.cpu_count()} cores, {rounds} rounds, {load}")
    print("| set-up | output tok/s | TTFT p50 ms | TPOT p50 ms | failed | routed per worker |")
    print("|---|---:|---:|---:|---:|---|")
    for setup in SETUPS:
        name = setup.name
        print(
            f"| {name} | {median(name, 'output_throughput'):.1f} "
            f"| {median(name, 'median_ttft_ms'):.0f} | {median(name, 'median_tpot_ms'):.1f} "
            f"| {sum(s['failed'] for s in results[name])} | {spread[name]} |"
        )
    two_threads, two_workers, one_thread = (setup.name for setup in SETUPS)
    for name in (two_threads, one_thread):
        ratio = median(two_workers, "output_throughput") / median(name, "output_throughput")
        print(f"throughput, {two_workers} / {name}: {ratio:.2f}")


if __name__ == "__main__":
    main()
