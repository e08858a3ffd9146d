"""The RAM prompt cache (`--cache-ram`) on multi-turn chats, side by side in one run.

Three servers run the same loads in alternating order, round after round:
  - loomserve with the RAM cache (`--cache-ram MIB`),
  - loomserve without it (`--cache-ram 0`: only what is still in a slot is reused),
  - llama-server with its default `--cache-ram` (when its binary is there),
all with the same model, threads, slots and context per slot. The multi-turn load is
`loomserve bench --dataset multi-turn`: N conversations x T turns, every conversation active
at once, each turn sending its whole history (chat endpoint) after the turn before it ended.
It prints TTFT p50 of the first turn and of the later turns (the ones a cache can serve),
cached prompt tokens as the servers report them, and output tokens/s; then the plain load
(random prompts at two concurrencies) with and without the cache. Medians over the rounds.

    python -m benchmarks.bench_prompt_cache                # default model, 2 threads
    python -m benchmarks.bench_prompt_cache --rounds 3 --conversations 32 --turns 4
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomserve.cli.bench.client import StreamingClient
from loomserve.cli.bench.datasets import (
    BenchRequest,
    approximate_token_counts,
    multi_turn_dataset,
    random_dataset,
)
from loomserve.cli.bench.records import RequestRecord
from loomserve.cli.bench.runner import LoadShape, run_load, warm_up
from loomserve.cli.default_model import resolve_model

LLAMA_SERVER = Path("/work/llama-server/build/bin/llama-server")


@dataclass(frozen=True, slots=True)
class Server:
    """One server under test: how to start it."""

    name: str
    argv: list[str]
    ready_path: str  # GET answers 200 once it serves


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loomserve(name: str, model: Path, port: int, cache_ram: int, opts: dict) -> Server:
    argv = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(model)]
    argv += ["--port", str(port), "--threads", str(opts["threads"]), "--slots", str(opts["slots"])]
    argv += ["--ctx-size", str(opts["ctx_size"]), "--cache-ram", str(cache_ram), "--log-json"]
    return Server(name, argv, "/health")


def llama_server(model: Path, port: int, opts: dict) -> Server:
    argv = [str(LLAMA_SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["-t", str(opts["threads"]), "-tb", str(opts["threads"]), "-np", str(opts["slots"])]
    argv += ["-c", str(opts["ctx_size"] * opts["slots"]), "--no-webui"]
    return Server("llama-server (default --cache-ram)", argv, "/health")


def start(server: Server, url: str, log: Path, timeout: float = 180.0) -> subprocess.Popen:
    with log.open("ab") as out:
        process = subprocess.Popen(server.argv, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{server.name} exited; see {log}")
        try:
            if httpx.get(url + server.ready_path, timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    process.kill()
    raise SystemExit(f"{server.name} was not ready in {timeout:.0f} s; see {log}")


async def run(url: str, requests: Sequence[BenchRequest], concurrency: int | None, endpoint: str):
    client = StreamingClient(url, "default", endpoint, timeout_s=600.0)
    try:
        models = (await asyncio.to_thread(httpx.get, url + "/v1/models", timeout=5)).json()
        client.model = models["data"][0]["id"]
        await warm_up(client, requests[0], 1, None)
        return await run_load(
            client, requests, LoadShape(max_concurrency=concurrency), seed=0, progress=False
        )
    finally:
        await client.aclose()


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def multi_turn_figures(requests: Sequence[BenchRequest], records: list[RequestRecord], took: float):
    ok = [(q, r) for q, r in zip(requests, records, strict=True) if r.success]
    first = [r.ttft_s * 1000 for q, r in ok if q.turn == 0]
    later = [r.ttft_s * 1000 for q, r in ok if q.turn > 0]
    later_prompt = sum(r.input_tokens for q, r in ok if q.turn > 0)
    later_cached = sum(r.cached_tokens or 0 for q, r in ok if q.turn > 0)
    return {
        "ttft_first_p50_ms": p50(first),
        "ttft_later_p50_ms": p50(later),
        "later_cached_fraction": later_cached / later_prompt if later_prompt else 0.0,
        "output_tok_s": sum(r.output_tokens for _, r in ok) / took,
        "failed": len(records) - len(ok),
        "seconds": took,
    }


def plain_figures(records: list[RequestRecord], took: float) -> dict:
    ok = [r for r in records if r.success]
    return {
        "output_tok_s": sum(r.output_tokens for r in ok) / took,
        "ttft_p50_ms": p50([r.ttft_s * 1000 for r in ok]),
        "failed": len(records) - len(ok),
    }


@click.command()
@click.option("--model", default=None, help="GGUF model; default: Gemma 3 270M.")
@click.option("--rounds", type=int, default=2, help="Alternating rounds.")
@click.option("--conversations", type=int, default=32)
@click.option("--turns", type=int, default=4)
@click.option("--system-len", type=int, default=256, help="Tokens of each system prompt.")
@click.option("--user-len", type=int, default=64, help="Tokens of each user message.")
@click.option("--output-len", type=int, default=32, help="Tokens of each answer.")
@click.option("--threads", type=int, default=2)
@click.option("--slots", type=int, default=8)
@click.option("--ctx-size", type=int, default=2048, help="Context per slot.")
@click.option("--cache-ram", type=int, default=8192, help="MiB for loomserve's RAM cache.")
@click.option("--plain-prompts", type=int, default=24, help="Requests per plain-load run.")
@click.option("--plain/--no-plain", default=True, help="Also run the plain load.")
@click.option("--llama/--no-llama", default=True, help="Also run llama-server, if present.")
@click.option("--result-json", type=click.Path(path_type=Path), default=None)
def main(**opts) -> None:
    """Run the comparison and print tables (medians over the rounds)."""
    model = resolve_model(opts["model"])
    workdir = Path(tempfile.mkdtemp(prefix="bench-prompt-cache-"))
    ports = [free_port() for _ in range(3)]
    servers = [
        loomserve("loomserve, RAM cache", model, ports[0], opts["cache_ram"], opts),
        loomserve("loomserve, no RAM cache", model, ports[1], 0, opts),
    ]
    if opts["llama"] and LLAMA_SERVER.exists():
        servers.append(llama_server(model, ports[2], opts))
    urls = {s.name: f"http://127.0.0.1:{ports[i]}" for i, s in enumerate(servers)}
    chats = multi_turn_dataset(
        opts["conversations"],
        opts["turns"],
        opts["system_len"],
        opts["user_len"],
        opts["output_len"],
        0.0,
        1,
        approximate_token_counts,
    )
    # Other prompts at each concurrency: a repeat would be a cache hit, not the plain load.
    plain = {
        concurrency: random_dataset(
            opts["plain_prompts"], 256, 64, 0.0, seed, approximate_token_counts
        )
        for seed, concurrency in enumerate((4, 16), start=2)
    }
    multi: dict[str, list[dict]] = {s.name: [] for s in servers}
    flat: dict[tuple[str, int], list[dict]] = {}
    for round_index in range(opts["rounds"]):
        order = servers if round_index % 2 == 0 else list(reversed(servers))
        for server in order:
            url = urls[server.name]
            # One server at a time on the machine: none idles beside another's load.
            process = start(server, url, workdir / f"{len(multi[server.name])}-{ports[0]}.log")
            try:
                began = time.perf_counter()
                result = asyncio.run(run(url, chats, None, "chat"))
                figures = multi_turn_figures(chats, result.records, time.perf_counter() - began)
                multi[server.name].append(figures)
                print(f"round {round_index + 1} {server.name}: {json.dumps(figures)}", flush=True)
                if opts["plain"] and server.name.startswith("loomserve"):
                    for concurrency in (4, 16):
                        requests = plain[concurrency]
                        result = asyncio.run(run(url, requests, concurrency, "completions"))
                        figures = plain_figures(result.records, result.duration_s)
                        flat.setdefault((server.name, concurrency), []).append(figures)
                        print(f"  plain c={concurrency}: {json.dumps(figures)}", flush=True)
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(60)
    report(opts, model, servers, multi, flat)
    if opts["result_json"]:
        rows = {"multi_turn": multi, "plain": {f"{k[0]} c={k[1]}": v for k, v in flat.items()}}
        Path(opts["result_json"]).write_text(json.dumps({"settings": opts, **rows}, default=str))


def report(opts: dict, model: Path, servers, multi: dict, flat: dict) -> None:
    def median(rows: list[dict], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    print(
        f"\nmodel {model.name}, {os.cpu_count()} cores, threads {opts['threads']}, slots "
        f"{opts['slots']}, {opts['conversations']} conversations x {opts['turns']} turns "
        f"(system {opts['system_len']}, user {opts['user_len']}, answers {opts['output_len']} "
        f"tokens), {opts['rounds']} rounds"
    )
    print("| server | TTFT p50 turn 1 ms | TTFT p50 turns 2+ ms | cached, turns 2+ | tok/s |")
    print("|---|---:|---:|---:|---:|")
    for server in servers:
        rows = multi[server.name]
        print(
            f"| {server.name} | {median(rows, 'ttft_first_p50_ms'):.0f} "
            f"| {median(rows, 'ttft_later_p50_ms'):.0f} "
            f"| {median(rows, 'later_cached_fraction'):.0%} | {median(rows, 'output_tok_s'):.1f} |"
        )
    names = [s.name for s in servers]
    cached = median(multi[names[0]], "ttft_later_p50_ms")
    base = median(multi[names[1]], "ttft_later_p50_ms")
    print(f"TTFT p50 turns 2+, no cache / cache: {base / cached:.2f}x")
    if len(names) > 2:
        theirs = median(multi[names[2]], "ttft_later_p50_ms")
        print(f"TTFT p50 turns 2+, llama-server / loomserve with cache: {theirs / cached:.2f}x")
    if flat:
        print("\n| plain load | output tok/s, cache | output tok/s, no cache | ratio |")
        print("|---|---:|---:|---:|")
        for concurrency in (4, 16):
            on = median(flat[(names[0], concurrency)], "output_tok_s")
            off = median(flat[(names[1], concurrency)], "output_tok_s")
            print(f"| random 256/64, c={concurrency} | {on:.1f} | {off:.1f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()
