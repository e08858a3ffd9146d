"""Grammar-constrained generation against plain generation, on loomserve and llama-server.

Four workloads through /v1/chat/completions, greedy, max_tokens 64: a json_schema
response_format against plain text with the same prompt (ignore_eos), and a forced tool call
(a named tool_choice; both servers turn its parameters schema into a grammar) against plain
text with the same tool in the prompt (tool_choice auto, ignore_eos). The schema's story is
longer than any 64 tokens, so every answer is 64 tokens long, and each grammar is set against
a reference of the same prompt: the ratios are the grammars' cost per token. Each runs
at concurrency 1, 4 and 16 on `loomserve serve` (one worker, 16 slots, 2 threads) and, when
the binary is there, on llama-server (`-np 16 -t 2`, the same model file). Both servers stay up for
the whole run and take turns, workload by workload, so the machine's noise falls on all alike;
the order flips every round. It prints, per server, workload and concurrency, the median of
each request's tokens/s (completion tokens over its whole latency) and the aggregate tokens/s
(all tokens of a wave over the wave's time), and grammar/plain ratios.

    python -m benchmarks.bench_grammar                   # the default model, 2 rounds
    python -m benchmarks.bench_grammar --rounds 3 --llama-server ''   # loomserve only
    python -m benchmarks.bench_grammar --workloads plain,tool_call
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_spec import llama_server_cpu_args
from loomserve.cli.default_model import resolve_model
from loomserve.gateway.tools.template import system_with_tools

# .ci/build-llama-server's binary (the same llama.cpp as llama-cpp-python's), or the variable.
LLAMA_SERVER = os.environ.get(
    "LOOMSERVE_LLAMA_SERVER",
    str(Path.home() / ".cache/loomserve/llama-server-0.3.36/llama-server"),
)
SLOTS = 16
THREADS = 2
SLOT_CONTEXT = 2048
TOPICS = ("a lighthouse", "a red fox", "the moon", "a small boat", "an old clock", "rain")
# A story at least 1,000 characters long: no output of max_tokens (64) completes it, so every
# answer is max_tokens long and the workloads differ only in what holds the tokens.
STORY_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "story": {"type": "string", "minLength": 1000}},
    "required": ["title", "story"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "save_story",
        "description": "Save a story with its title.",
        "parameters": STORY_SCHEMA,
    },
}


def workload_body(
    workload: str, topic: str, max_tokens: int, server: str = "loomserve"
) -> dict[str, Any]:
    """The chat request of one workload about one topic. A grammar's workload and its plain
    reference have the same prompt (REFERENCE): json_schema and plain no tools, tool_call and
    plain_tools the tool. loomserve ends a reply at a whole call under tool_choice auto, so its
    plain_tools writes the tool into the system message as its gateway does for this model
    (whose template shows no tools); llama-server's is tool_choice auto."""
    ask = f"Write a long story about {topic}, in JSON with a title and the story, and save it."
    body: dict[str, Any] = {
        "temperature": 0,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": ask}],
    }
    if workload == "plain":
        return {**body, "ignore_eos": True}
    if workload == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY_SCHEMA}}
        return {**body, "response_format": fmt}
    if workload == "plain_tools" and server == "loomserve":
        system = {"role": "system", "content": system_with_tools("", [TOOL])}
        return {**body, "messages": [system, *body["messages"]], "ignore_eos": True}
    if workload == "plain_tools":
        return {**body, "tools": [TOOL], "tool_choice": "auto", "ignore_eos": True}
    choice = {"type": "function", "function": {"name": "save_story"}}
    return {**body, "tools": [TOOL], "tool_choice": choice}


REFERENCE = {"json_schema": "plain", "tool_call": "plain_tools"}
WORKLOADS = ("plain", "json_schema", "plain_tools", "tool_call")


@dataclass(slots=True)
class Samples:
    """What one server, workload and concurrency measured over the rounds."""

    per_request: list[float] = field(default_factory=list)  # tokens/s of each request
    aggregate: list[float] = field(default_factory=list)  # tokens/s of each wave
    tokens: list[int] = field(default_factory=list)  # completion tokens of each request
    errors: int = 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_loomserve(model: Path, port: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--threads", str(THREADS)]
    argv += ["--slots", str(SLOTS), "--ctx-size", str(SLOT_CONTEXT), "--log-json"]
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def start_llama_server(binary: str, model: Path, port: int, log: Path) -> subprocess.Popen:
    argv = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-np", str(SLOTS), "-t", str(THREADS), "-tb", str(THREADS)]
    argv += ["-c", str(SLOTS * SLOT_CONTEXT), "--jinja", "--no-webui", *llama_server_cpu_args()]
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} was not healthy within {timeout:.0f} s")


def one_request(url: str, body: dict[str, Any]) -> tuple[int, float] | None:
    """(completion tokens, seconds) of one non-streamed request; None when it failed."""
    started = time.perf_counter()
    try:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    except httpx.HTTPError:
        return None
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        print(f"  {url}: {response.status_code} {response.text[:200]}", flush=True)
        return None
    return response.json()["usage"]["completion_tokens"], seconds


def wave(
    url: str,
    server: str,
    workload: str,
    concurrency: int,
    first: int,
    max_tokens: int,
    out: Samples,
):
    """`concurrency` requests at once, about different topics; one aggregate sample."""
    bodies = [
        workload_body(workload, TOPICS[(first + i) % len(TOPICS)], max_tokens, server)
        for i in range(concurrency)
    ]
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda body: one_request(url, body), bodies))
    elapsed = time.perf_counter() - started
    done = [result for result in results if result is not None]
    out.errors += len(results) - len(done)
    for tokens, seconds in done:
        out.per_request.append(tokens / seconds)
        out.tokens.append(tokens)
    if done:
        out.aggregate.append(sum(tokens for tokens, _ in done) / elapsed)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@click.command()
@click.option("--model", default=None, help="GGUF model; default: Gemma 3 270M.")
@click.option("--rounds", type=int, default=2, help="Rounds; the order flips each round.")
@click.option("--max-tokens", type=int, default=64, help="Output tokens per request.")
@click.option("--sequential", type=int, default=2, help="Requests one after another at c=1.")
@click.option(
    "--concurrency", default="1,4,16", help=f"Comma-separated waves' sizes, at most {SLOTS}."
)
@click.option(
    "--llama-server", "llama_server", default=LLAMA_SERVER, help="Binary; '' to leave it out."
)
@click.option(
    "--workloads",
    default=",".join(WORKLOADS),
    help="Comma-separated, of: plain, json_schema, plain_tools, tool_call (json_schema is "
    "set against plain, tool_call against plain_tools: the same prompts).",
)
def main(
    model: str | None,
    rounds: int,
    max_tokens: int,
    sequential: int,
    concurrency: str,
    llama_server: str,
    workloads: str,
):
    """Run every workload on every server, interleaved, and print the medians."""
    model_path = resolve_model(model)
    workdir = Path(tempfile.mkdtemp(prefix="bench-grammar-"))
    servers: dict[str, tuple[str, subprocess.Popen]] = {}
    port = free_port()
    servers["loomserve"] = (
        f"http://127.0.0.1:{port}",
        start_loomserve(model_path, port, workdir / "loomserve.log"),
    )
    if llama_server and Path(llama_server).exists():
        port = free_port()
        servers["llama-server"] = (
            f"http://127.0.0.1:{port}",
            start_llama_server(llama_server, model_path, port, workdir / "llama-server.log"),
        )
    samples: dict[tuple[str, str, int], Samples] = {}
    try:
        for name, (url, process) in servers.items():
            wait_healthy(url, process)
            for workload in WORKLOADS:  # warm up: load pages, compile nothing twice
                one_request(url, workload_body(workload, "warming up", 8, name))
        chosen = [w for w in WORKLOADS if w in workloads.split(",")]
        sizes = [int(c) for c in concurrency.split(",")]
        if max(sizes) > SLOTS:
            raise SystemExit(f"--concurrency: at most {SLOTS}, the servers' slots")
        runs = [(w, c, s) for w in chosen for c in sizes for s in servers]
        for round_index in range(rounds):
            for workload, size, server in runs if round_index % 2 == 0 else runs[::-1]:
                url = servers[server][0]
                out = samples.setdefault((server, workload, size), Samples())
                if size == 1:
                    for i in range(sequential):
                        wave(url, server, workload, 1, round_index + i, max_tokens, out)
                else:
                    wave(url, server, workload, size, round_index, max_tokens, out)
                print(
                    f"round {round_index + 1} {server} {workload} c={size}: "
                    f"{median(out.per_request):.2f} tok/s per request",
                    flush=True,
                )
    finally:
        for _, process in servers.values():
            process.send_signal(signal.SIGTERM)
        for _, process in servers.values():
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()

    print(
        f"\nmodel {model_path.name}, {os.cpu_count()} cores, threads {THREADS}, slots {SLOTS}, "
        f"{rounds} rounds, max_tokens {max_tokens}, greedy; logs in {workdir}"
    )
    print("| server | workload | c | tok/s per request (p50) | aggregate tok/s (p50) |", end="")
    print(" tokens/request (p50) | vs plain | errors |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (server, workload, concurrency), out in sorted(samples.items()):
        plain = samples.get((server, REFERENCE.get(workload, workload), concurrency))
        ratio = median(out.per_request) / median(plain.per_request) if plain else float("nan")
        print(
            f"| {server} | {workload} | {concurrency} | {median(out.per_request):.2f} "
            f"| {median(out.aggregate):.2f} | {median([float(t) for t in out.tokens]):.0f} "
            f"| {ratio:.2f} | {out.errors} |"
        )
    summary = {
        f"{server}/{workload}/c{concurrency}": {
            "per_request_tok_s": median(out.per_request),
            "aggregate_tok_s": median(out.aggregate),
            "tokens": out.tokens,
            "errors": out.errors,
        }
        for (server, workload, concurrency), out in samples.items()
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
