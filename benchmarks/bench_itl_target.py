"""The latency target's trade-off: ITL p99, TTFT and throughput with and without a target.

Starts `loomserve serve` once per setting and round, in alternation (the machine is shared and
noisy: alternating spreads its moods over every setting), drives it with `loomserve bench`
(random 128-token prompts, 64 output tokens, a closed loop of N concurrent requests), and
prints the medians per setting and their ratios to the first setting. With --plot it draws
ITL p99 and output throughput against the target.

    python -m benchmarks.bench_itl_target --rounds 3 --targets 100,150,200,300 --plot docs/itl.png
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
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomserve.cli.bench.runner import LoadShape
from loomserve.cli.bench.session import BenchConfig, run_session
from loomserve.cli.default_model import resolve_model

KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(model: Path, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(model)]
    args += ["--port", str(port), "--slots", "8", "--ctx-size", "2048"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            args + extra, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited; see {log}")
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"serve did not become healthy; see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def one_run(model: Path, extra: list[str], concurrency: int, prompts: int, seed: int) -> dict:
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"bench-itl-{port}.log"
    proc = serve(model, port, extra, log)
    try:
        config = BenchConfig(
            base_url=f"http://127.0.0.1:{port}",
            input_len=128,
            output_len=64,
            num_prompts=prompts,
            shape=LoadShape(max_concurrency=concurrency),
            seed=seed,
            progress=False,
        )
        result = run_session(config, echo=lambda *a, **k: None, warn=lambda *a: None)
        return result["summary"]
    finally:
        stop(proc)


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--targets", default="100,150,200,300", help="ITL targets in ms.")
@click.option("--rounds", type=int, default=3)
@click.option("--prompts", type=int, default=32)
@click.option("--concurrency", type=int, default=8)
@click.option("--strategy", default="decode-maximal")
@click.option("--threads", type=int, default=2)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(
    model: str | None,
    targets: str,
    rounds: int,
    prompts: int,
    concurrency: int,
    strategy: str,
    threads: int,
    json_out: Path | None,
    plot: Path | None,
) -> None:
    """Alternate no target and each target, `rounds` times; print medians and ratios."""
    path = resolve_model(model)
    common = ["--strategy", strategy, "--threads", str(threads)]
    settings: dict[str, list[str]] = {"none": common}
    for target in targets.split(","):
        if target.strip():
            settings[target.strip()] = [*common, "--itl-target-ms", target.strip()]
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for round_ in range(rounds):
        for name, extra in settings.items():
            summary = one_run(path, extra, concurrency, prompts, seed=round_)
            runs[name].append(summary)
            values = " ".join(f"{k}={summary[k]:.1f}" for k in KEYS)
            click.echo(f"round {round_} target {name}: {values}", err=True)
    medians = {
        name: {k: statistics.median(s[k] for s in summaries) for k in KEYS}
        for name, summaries in runs.items()
    }
    base = medians["none"]
    click.echo(f"\n{concurrency} concurrent, {prompts} prompts, {strategy}, medians of {rounds}")
    click.echo(
        "target ms | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | tput/none | TTFT/none"
    )
    for name, m in medians.items():
        click.echo(
            f"{name:>9} | {m['output_throughput']:9.1f} | {m['median_ttft_ms']:8.0f} | "
            f"{m['p99_ttft_ms']:8.0f} | {m['median_itl_ms']:7.0f} | {m['p99_itl_ms']:7.0f} | "
            f"{m['output_throughput'] / base['output_throughput']:9.2f} | "
            f"{m['median_ttft_ms'] / base['median_ttft_ms']:9.2f}"
        )
    if json_out:
        json_out.write_text(json.dumps({"runs": runs, "medians": medians}, indent=2))
    if plot:
        draw(plot, medians, concurrency)


def draw(path: Path, medians: dict[str, dict], concurrency: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = [name for name in medians if name != "none"]
    xs = [float(t) for t in targets]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(xs, [medians[t]["p99_itl_ms"] for t in targets], "o-", label="ITL p99")
    left.plot(xs, [medians[t]["median_ttft_ms"] for t in targets], "s-", label="TTFT p50")
    left.plot(xs, xs, ":", color="grey", label="the target")
    left.plot(xs, [1.5 * x for x in xs], "--", color="grey", label="1.5 × target")
    for key, style in (("p99_itl_ms", "o"), ("median_ttft_ms", "s")):
        left.axhline(medians["none"][key], color="C0" if style == "o" else "C1", alpha=0.4)
    left.set_xlabel("--itl-target-ms")
    left.set_ylabel("ms (flat lines: no target)")
    left.legend(fontsize=8)
    right.plot(xs, [medians[t]["output_throughput"] for t in targets], "o-", label="target")
    right.axhline(medians["none"]["output_throughput"], color="grey", label="no target")
    right.set_xlabel("--itl-target-ms")
    right.set_ylabel("output tokens/s")
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    fig.suptitle(f"Gemma 3 270M, 2 CPU cores, 8 slots, {concurrency} concurrent, 128 in / 64 out")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
