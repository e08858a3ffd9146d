"""Where one stream's time goes: loomserve against llama-server, a request at a time.

`bench_sampled`'s "greedy c=1" says how the two servers compare; this says why. Both serve the
same model with the same threads and slots (`bench_sampled`'s settings); rounds alternate the
servers on the same prompts (new ones every round: a server keeps what it prefilled), after
a request each to warm up (its prompt's pass is left out):

- the client's view: time to first token, the time per token after it, tokens per second;
- the server's own: the prompt's pass and the step per token, from loomserve's tick log
  (`--log-ticks`: a prefill tick, the decode ticks) and llama-server's `print_timing` lines
  (`prompt eval time`, `eval time`);
- CPU per streamed token, user and system, of each of the server's processes and of this
  client (/proc): what runs beside the forward passes on the same cores.

    python -m benchmarks.bench_single_stream --rounds 4 --llama-server PATH
    python -m benchmarks.bench_single_stream --threads 1   # a core left for the rest

Not a test: read the numbers (the machine is shared).
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_sampled as sampled
from benchmarks.bench_spec import free_port, stop
from benchmarks.procfs import processes
from loomserve.cli.default_model import resolve_model

WORDS = (
    "river stone market window lantern harbor meadow copper signal garden orchard valley "
    "engine letter winter thread compass island bridge candle"
).split()


@dataclass
class Served:
    """One server's figures over a run: a row per request, its CPU time per process."""

    ttft_s: list[float] = field(default_factory=list)
    per_token_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    tokens: int = 0
    cpu_s: dict[str, list[float]] = field(default_factory=dict)  # process: user, system


def process_tree_cpu(root: int) -> dict[int, tuple[str, float, float]]:
    """Each process under root (root included): its command's role, user and system CPU
    seconds so far."""
    listed = processes()
    parents = {process.pid: process.parent for process in listed}
    stats = {
        process.pid: (role(process.command), process.user_s, process.system_s) for process in listed
    }
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in stats:
            tree[pid] = stats[pid]
        frontier += [child for child, parent in parents.items() if parent == pid]
    return tree


def role(command: list[str]) -> str:
    """What a server process is: llama-server, or loomserve's supervisor, gateway or worker."""
    if command and command[0].endswith("llama-server"):
        return "llama-server"
    for name in ("gateway", "worker", "serve"):
        if name in command:
            return "loomserve " + ("supervisor" if name == "serve" else name)
    return Path(command[0]).name if command else "?"


def cpu_between(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    """User and system seconds each role used between two readings of the tree."""
    used: dict[str, tuple[float, float]] = {}
    for pid, (name, user, system) in after.items():
        _, user0, system0 = before.get(pid, (name, 0.0, 0.0))
        total = used.get(name, (0.0, 0.0))
        used[name] = (total[0] + user - user0, total[1] + system - system0)
    return used


def stream(base_url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """One streamed completion: seconds to its first chunk, to its last, and its chunks."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,  # every token asked for comes, as in bench_sampled
    }
    url = f"{base_url}/v1/completions"
    started, stamps = time.perf_counter(), []
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter() - started)
    return stamps[0], stamps[-1], len(stamps)


def run_requests(served: Served, base_url: str, root: int, prompts: list[str], tokens: int):
    """The prompts one after another; their timings and the CPU each process used."""
    before, client_before = process_tree_cpu(root), os.times()
    for prompt in prompts:
        first, last, chunks = stream(base_url, prompt, tokens)
        served.ttft_s.append(first)
        served.per_token_s.append((last - first) / max(1, chunks - 1))
        served.e2e_s.append(last)
        served.tokens += chunks
    client_after = os.times()
    used = cpu_between(before, process_tree_cpu(root))
    used["client (this process)"] = (
        client_after.user - client_before.user,
        client_after.system - client_before.system,
    )
    for name, (user, system) in used.items():
        total = served.cpu_s.setdefault(name, [0.0, 0.0])
        total[0] += user
        total[1] += system


def loomserve_steps(log: Path) -> tuple[list[float], list[float]]:
    """loomserve's tick log: the ticks with prompt tokens (ms), and those without."""
    prefill, decode = [], []
    for line in log.read_text().splitlines():
        if not line.startswith("{") or '"event": "tick"' not in line:
            continue
        tick = json.loads(line)
        (prefill if tick.get("prefill_tokens") else decode).append(float(tick["tick_ms"]))
    return prefill, decode


PROMPT_EVAL = re.compile(r"prompt eval time =\s+([\d.]+) ms /\s+(\d+) tokens")
EVAL = re.compile(r"\|\s+eval time =\s+([\d.]+) ms /\s+(\d+) tokens")


def llama_server_steps(log: Path) -> tuple[list[float], list[float]]:
    """llama-server's print_timing lines: each prompt's pass (ms), each request's ms a token."""
    text = log.read_text()
    prompts = [float(ms) for ms, _ in PROMPT_EVAL.findall(text)]
    steps = [float(ms) / int(n) for ms, n in EVAL.findall(text) if int(n) > 0]
    return prompts, steps


def median_ms(values: list[float], scale: float = 1.0) -> str:
    """The median of `values` times `scale`, in milliseconds; "-" for none."""
    return f"{statistics.median(values) * scale:.2f}" if values else "-"


def mean_ms(values: list[float], scale: float = 1.0) -> str:
    """The mean: a request's time per token is a mean over its tokens, slow ones included."""
    return f"{statistics.fmean(values) * scale:.2f}" if values else "-"


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--rounds", type=int, default=4, show_default=True)
@click.option("--requests", type=int, default=6, show_default=True, help="Per server a round.")
@click.option("--tokens", type=int, default=sampled.OUTPUT_TOKENS, show_default=True)
@click.option("--prompt-words", type=int, default=16, show_default=True)
@click.option("--threads", type=int, default=2, show_default=True)
@click.option(
    "--llama-server", "binary", type=click.Path(path_type=Path), default=sampled.LLAMA_SERVER
)
@click.option(
    "--loomserve-args",
    default="",
    help='More `loomserve serve` options, e.g. "--no-batch-invariant".',
)
def main(
    model: str | None,
    rounds: int,
    requests: int,
    tokens: int,
    prompt_words: int,
    threads: int,
    binary: Path,
    loomserve_args: str,
) -> None:
    """Alternate loomserve and llama-server a request at a time; where each one's time goes."""
    path = resolve_model(model)
    procs: dict[str, tuple[object, str, Path]] = {}
    try:
        port = free_port()
        proc = sampled.loomserve(path, port, threads, ["--log-ticks", *loomserve_args.split()])
        procs["loomserve"] = (proc, f"http://127.0.0.1:{port}", sampled.server_log("loom", port))
        if binary.exists():
            port = free_port()
            proc = sampled.llama_server(path, port, threads, binary, [])
            log = sampled.server_log("llama", port)
            procs["llama-server"] = (proc, f"http://127.0.0.1:{port}", log)
        else:
            click.echo(f"no llama-server at {binary}: loomserve only", err=True)
        for _, base_url, _ in procs.values():  # the first pass of each shape builds graphs
            stream(base_url, "warm up", tokens)
        served = {name: Served() for name in procs}
        for round_ in range(rounds):
            rng = random.Random(round_)
            prompts = [
                " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(prompt_words))
                for _ in range(requests)
            ]
            for name, (proc, base_url, _) in procs.items():
                run_requests(served[name], base_url, proc.pid, prompts, tokens)  # type: ignore[attr-defined]
                rate = served[name].tokens / sum(served[name].e2e_s)
                click.echo(f"round {round_} {name}: {rate:.1f} tok/s so far", err=True)
        steps = {
            "loomserve": loomserve_steps(procs["loomserve"][2]),
            "llama-server": llama_server_steps(procs["llama-server"][2])
            if "llama-server" in procs
            else ([], []),
        }
    finally:
        for proc, _, _ in procs.values():
            stop(proc)  # type: ignore[arg-type]

    click.echo(
        f"\n{path.name}, {threads} threads, {sampled.SLOTS} slots, {prompt_words}-word prompts, "
        f"{tokens} tokens, {requests} requests x {rounds} rounds a server, one at a time"
    )
    click.echo(
        "server | tok/s | TTFT ms (median) | ms/token after the first (mean) | "
        "prompt pass ms (median) | step ms/token (mean)"
    )
    for name, figures in served.items():
        prompt_passes, step_s = steps[name]
        prompt_passes = prompt_passes[1:]  # the warm-up request's
        rate = figures.tokens / sum(figures.e2e_s)
        click.echo(
            f"{name} | {rate:.1f} | {median_ms(figures.ttft_s, 1000)} | "
            f"{mean_ms(figures.per_token_s, 1000)} | {median_ms(prompt_passes)} | "
            f"{mean_ms(step_s)}"
        )
    click.echo("\nCPU ms per streamed token: user + system")
    for name, figures in served.items():
        for process, (user, system) in sorted(figures.cpu_s.items()):
            per = 1000 / figures.tokens
            click.echo(f"{name} | {process} | {user * per:.2f} + {system * per:.2f}")


if __name__ == "__main__":
    main()
