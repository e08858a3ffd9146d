"""Serving on a shared CPU: loomserve and llama-server beside busy-looping processes.

A CPU model server rarely has its cores to itself (a laptop's browser, a CI runner's other
jobs, a pod at its CPU limit). This runs issue 61's table: 1 and 4 streams (completions,
greedy, `ignore_eos`, OUTPUT tokens each), on each server alone, then beside 2 and 4
processes that busy-loop, every server with the same threads and model. Each repetition goes
through every busy level, and within it every stream count on every server, alternating
(the servers' order turns each time), so the machine's moods spread over all of them.

It prints, per cell, the median and the worst tok/s over the repetitions and the median ITL;
then each busy cell's worst against the server's quiet median (issue 61's goals, in the worst
of 5 repetitions: at least 0.4 with 2 busy processes and 0.25 with 4), and loomserve's worst
against llama-server's. Every run is bounded (`--run-seconds`); tok/s counts every token
streamed within it, of finished requests and of those the bound cut short (counting finished
requests alone would read in steps of a whole round of requests: 4 streams of 64 tokens cut
at 20 s read 12.8 or 25.6 tok/s and nothing between).

    python -m benchmarks.bench_shared_cpu --repetitions 5
    LOOMSERVE_LLAMA_SERVER=/path/to/llama-server python -m benchmarks.bench_shared_cpu
    python -m benchmarks.bench_shared_cpu --variant GOMP_SPINCOUNT=10000  # a wait policy A/B
    python -m benchmarks.bench_shared_cpu --output-tokens 4 --repetitions 1 --busy 0,2  # smoke

Run it on a machine nobody else uses: the busy processes take every core, and anyone else's
work there both disturbs the figures and is disturbed.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_spec import free_port, llama_server_cpu_args, start, stop
from loomserve.cli.bench.runner import LoadShape
from loomserve.cli.bench.session import BenchConfig, run_session
from loomserve.cli.default_model import resolve_model

SLOTS = 4
CTX_PER_SLOT = 512
INPUT_TOKENS = 32
GOALS = {2: 0.4, 4: 0.25}  # busy processes: the worst repetition's share of the quiet median


@dataclass(frozen=True, slots=True)
class Run:
    """One load on one server: tokens a second (every token streamed in the run) and ITL."""

    tok_s: float
    median_itl_ms: float | None
    p99_itl_ms: float | None
    unfinished: int


def loomserve(
    model: Path, port: int, threads: int, env: dict[str, str], own_session: bool
) -> subprocess.Popen:
    args = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(model)]
    args += ["--port", str(port), "--slots", str(SLOTS), "--ctx-size", str(CTX_PER_SLOT)]
    args += ["--threads", str(threads)]
    log = Path(tempfile.gettempdir()) / f"bench-shared-cpu-loom-{port}.log"
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # serve's workers inherit it (a user's GOMP_* is kept)
    try:
        return start(args, port, log, own_session)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def llama_server(
    model: Path, port: int, threads: int, binary: Path, own_session: bool
) -> subprocess.Popen:
    args = [str(binary), "-m", str(model), "--port", str(port), "--host", "127.0.0.1"]
    args += ["-t", str(threads), "-tb", str(threads), "-np", str(SLOTS)]
    args += ["-c", str(SLOTS * CTX_PER_SLOT), "--no-webui", *llama_server_cpu_args()]
    log = Path(tempfile.gettempdir()) / f"bench-shared-cpu-llama-{port}.log"
    return start(args, port, log, own_session)


def busy_loops(count: int, own_sessions: bool) -> list[subprocess.Popen]:
    """`count` processes that spin on a core each until stopped, each in a process group of
    its own (ended whole), and in a session of its own or the bench's (own_sessions)."""
    code = "while True: pass"
    group = {"start_new_session": True} if own_sessions else {"process_group": 0}
    return [subprocess.Popen([sys.executable, "-c", code], **group) for _ in range(count)]


def end_busy_loops(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_load(base_url: str, streams: int, output_tokens: int, seed: int, seconds: float) -> Run:
    """`streams` closed-loop streams, two requests each, bounded by `seconds`."""
    config = BenchConfig(
        base_url=base_url,
        endpoint="completions",
        dataset="random",
        input_len=INPUT_TOKENS,
        output_len=output_tokens,
        num_prompts=2 * streams,
        shape=LoadShape(max_concurrency=streams),
        seed=seed,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        progress=False,
        num_warmups=0,
        duration_s=seconds,
        scrape_metrics=False,
        save_detailed=True,
    )
    result = run_session(config, echo=lambda *a, **k: None, warn=lambda *a: None)
    summary = result["summary"]
    streamed = sum(request["chunks"] for request in result["requests"])
    return Run(
        streamed / summary["duration"],
        summary.get("median_itl_ms"),
        summary.get("p99_itl_ms"),
        summary.get("unfinished", 0),
    )


def parse_variant(text: str) -> dict[str, str]:
    """'GOMP_SPINCOUNT=10000 OMP_WAIT_POLICY=PASSIVE' -> their environment."""
    env = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{item!r}: give NAME=VALUE")
        env[name] = value
    return env


def report(
    runs: dict[str, list[Run]], servers: list[str], busy: list[int], streams: list[int]
) -> list[str]:
    """The table, the ratios and the goals, as lines."""
    lines = ["cell | " + " | ".join(f"{s}: median / worst tok/s, ITL p50 ms" for s in servers)]

    def cell(server: str, n_busy: int, n_streams: int) -> list[Run]:
        return runs[f"{server}|{n_busy}|{n_streams}"]

    for n_streams in streams:
        for n_busy in busy:
            parts = []
            for server in servers:
                got = cell(server, n_busy, n_streams)
                rates = [r.tok_s for r in got]
                itl = [r.median_itl_ms for r in got if r.median_itl_ms is not None]
                shown = f"{statistics.median(itl):.0f}" if itl else "-"
                parts.append(f"{statistics.median(rates):.1f} / {min(rates):.1f}, {shown}")
            lines.append(f"{n_streams} stream(s), +{n_busy} busy | " + " | ".join(parts))
    lines.append("")
    lines.append("worst busy repetition / quiet median (goal) | per server")
    for n_streams in streams:
        # Against the quiet cells, where this run measured them (--busy with 0).
        for n_busy in (b for b in busy if b and 0 in busy):
            ratios = []
            for server in servers:
                quiet = statistics.median(r.tok_s for r in cell(server, 0, n_streams))
                worst = min(r.tok_s for r in cell(server, n_busy, n_streams))
                ratios.append(f"{server} {worst / quiet:.2f}" if quiet else f"{server} -")
            goal = GOALS.get(n_busy)
            lines.append(
                f"{n_streams} stream(s), +{n_busy} busy (goal {goal if goal else '-'}) | "
                + ", ".join(ratios)
            )
    theirs = [s for s in servers if s.startswith("llama-server")]
    if theirs:
        lines.append("")
        lines.append("loomserve's worst / llama-server's worst, per cell")
        for server in (s for s in servers if s.startswith("loomserve")):
            for n_streams in streams:
                for n_busy in busy:
                    mine = min(r.tok_s for r in cell(server, n_busy, n_streams))
                    other = min(r.tok_s for r in cell(theirs[0], n_busy, n_streams))
                    ratio = f"{mine / other:.2f}" if other else "-"
                    lines.append(f"{server}, {n_streams} stream(s), +{n_busy} busy: {ratio}")
    return lines


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--repetitions", type=int, default=5, help="Runs of every cell; worst is kept.")
@click.option("--threads", type=int, default=2, help="Each server's threads.")
@click.option("--streams", default="1,4", help="Stream counts, comma-separated.")
@click.option("--busy", default="0,2,4", help="Busy-looping processes beside, comma-separated.")
@click.option("--output-tokens", type=int, default=64)
@click.option("--run-seconds", type=float, default=60.0, help="Bound on each run.")
@click.option(
    "--llama-server",
    "binary",
    type=click.Path(path_type=Path),
    default=lambda: os.environ.get("LOOMSERVE_LLAMA_SERVER"),
    help="llama-server's binary (default: $LOOMSERVE_LLAMA_SERVER); none: loomserve only.",
)
@click.option(
    "--variant",
    multiple=True,
    help="Another loomserve in the rotation, with this environment, e.g. "
    "'GOMP_SPINCOUNT=10000' or 'OMP_WAIT_POLICY=PASSIVE'. Repeatable.",
)
@click.option(
    "--busy-sessions",
    type=click.Choice(["shared", "own"]),
    default="shared",
    help="The busy loops in the bench's session, as loops started from the servers' shell "
    "(Linux's autogroup then shares the CPUs among threads), or each in a session of its "
    "own, as other programs on a desktop or other containers (the CPUs are shared among "
    "sessions first: the servers' gets 2/(n + 1) of 2 CPUs beside n loops).",
)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(
    model: str | None,
    repetitions: int,
    threads: int,
    streams: str,
    busy: str,
    output_tokens: int,
    run_seconds: float,
    binary: Path | None,
    variant: tuple[str, ...],
    busy_sessions: str,
    json_out: Path | None,
) -> None:
    """Every server at every stream count and busy level, `repetitions` times; the table."""
    # Stopped (SIGTERM, a timeout), it still ends its busy loops and servers: they run in
    # sessions of their own and would otherwise spin on, disturbing whatever runs next.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    path = resolve_model(model)
    own = busy_sessions == "own"  # the servers and loops each in a session of their own
    stream_counts = [int(n) for n in streams.split(",")]
    busy_levels = [int(n) for n in busy.split(",")]
    servers: dict[str, str] = {}
    procs: list[subprocess.Popen] = []
    runs: dict[str, list[Run]] = {}
    try:
        for extra in ("", *variant):
            port = free_port()
            procs.append(loomserve(path, port, threads, parse_variant(extra), own))
            servers[f"loomserve {extra}".strip()] = f"http://127.0.0.1:{port}"
        if binary is not None and Path(binary).exists():
            port = free_port()
            procs.append(llama_server(path, port, threads, Path(binary), own))
            servers["llama-server"] = f"http://127.0.0.1:{port}"
        else:
            click.echo("no llama-server binary (LOOMSERVE_LLAMA_SERVER): loomserve only", err=True)
        names = list(servers)
        cells = repetitions * len(busy_levels) * len(stream_counts) * len(names)
        click.echo(f"{cells} runs of at most {run_seconds:g} s each", err=True)
        turn = 0
        for repetition in range(repetitions):
            for n_busy in busy_levels:
                loops = busy_loops(n_busy, own)
                try:
                    time.sleep(0.5 if n_busy else 0)  # the loops take their cores first
                    for n_streams in stream_counts:
                        order = names[turn % len(names) :] + names[: turn % len(names)]
                        turn += 1
                        for name in order:
                            seed = (repetition * 100 + n_busy) * 10 + n_streams
                            run = run_load(
                                servers[name], n_streams, output_tokens, seed, run_seconds
                            )
                            runs.setdefault(f"{name}|{n_busy}|{n_streams}", []).append(run)
                            click.echo(
                                f"rep {repetition} +{n_busy} busy {n_streams} stream(s) {name}: "
                                f"{run.tok_s:.1f} tok/s, ITL p50 {run.median_itl_ms or 0:.1f} ms"
                                + (f", {run.unfinished} cut" if run.unfinished else ""),
                                err=True,
                            )
                finally:
                    end_busy_loops(loops)
    finally:
        for proc in procs:
            stop(proc)
    click.echo(
        f"\n{path.name}, {threads} threads, {output_tokens} tokens a request, "
        f"{repetitions} repetition(s), {os.cpu_count()} CPUs"
    )
    for line in report(runs, list(servers), busy_levels, stream_counts):
        click.echo(line)
    if json_out:
        as_dicts = {key: [asdict(run) for run in got] for key, got in runs.items()}
        json_out.write_text(json.dumps(as_dicts, indent=2))


if __name__ == "__main__":
    main()
