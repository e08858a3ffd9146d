"""The fifth audit's grammar cases on the default model, timed: does a stream beside them stall?

A canary (a plain streamed completion, ignore_eos) runs while 7 requests with the same wide
grammar arrive at once: `wide60` (60 alternatives of `[a-z ]* "q<i>z"`, 2.4 KB) and
`wide500` (500 of them), the grammars with which llama.cpp's grammar sampler once froze
every stream of the worker for half a minute. Then 5 requests with 128 tools of 800 optional
properties each (`tool_choice: required`), with a `json_object` chat beside them. It prints,
per case: the canary's worst gap between two tokens while the case ran (and its median),
each grammar request's status and seconds, and whether the worker stayed up (no watchdog
line in its log). Issue 56's goals: worst gap <= 0.5 s on a quiet machine, every grammar
request answered (200 or a fast 400), the oversized tools a 400 within 2 s each.

    python -m benchmarks.bench_grammar_canary              # the default model, 3 repetitions
    python -m benchmarks.bench_grammar_canary --repetitions 1 --model tiny.gguf

Run it alone on the machine (check the load average first): it measures stalls.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_grammar import free_port, start_loomserve, wait_healthy
from loomserve.cli.default_model import resolve_model


def wide(alternatives: int) -> str:
    """The audit's wide grammar (GBNF): many endings after a shared free prefix."""
    return "root ::= " + " | ".join(f'[a-z ]* "q{i}z"' for i in range(alternatives))


GRAMMARS = {"wide60": wide(60), "wide500": wide(500)}


@dataclass
class Canary:
    """Plain streams on a thread, one after another until stopped; when each token came."""

    url: str
    streams: list[list[float]] = field(default_factory=list)  # each stream's arrival times
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def tokens(self) -> int:
        return sum(len(arrivals) for arrivals in self.streams)

    def _read(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
        body |= {"stream": True, "temperature": 0}
        while not self.stop.is_set():
            arrivals: list[float] = []
            self.streams.append(arrivals)
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
                if r.status_code != 200:
                    self.errors.append(f"{r.status_code} {r.read()[:200]!r}")
                    return
                for line in r.iter_lines():
                    if self.stop.is_set():  # closing the stream cancels the request
                        return
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if "error" in json.loads(line[len("data: ") :]):
                        self.errors.append(line)
                        return
                    arrivals.append(time.perf_counter())

    def gaps_between(self, start: float, end: float) -> list[float]:
        """The gaps between a stream's tokens that arrived in [start, end] (each with the
        token before it)."""
        gaps = []
        for times in self.streams:
            times = [t for t in times if t <= end]
            gaps += [times[i] - times[i - 1] for i in range(1, len(times)) if times[i] >= start]
        return gaps


def grammar_case(url: str, grammar: str) -> list[tuple[int, float]]:
    """7 requests with `grammar` at once: each one's (status, seconds)."""
    body = {"prompt": "Say:", "max_tokens": 48, "temperature": 0, "grammar": grammar}

    def ask(_: int) -> tuple[int, float]:
        started = time.perf_counter()
        reply = httpx.post(url + "/v1/completions", json=body, timeout=600)
        return reply.status_code, time.perf_counter() - started

    with ThreadPoolExecutor(7) as pool:
        return list(pool.map(ask, range(7)))


def tools_case(url: str) -> list[tuple[int, float]]:
    """5 requests with 128 tools of 800 properties, and a json_object chat beside them (last)."""
    properties = {f"p{j}": {"type": "string"} for j in range(800)}
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"t{i}",
                "parameters": {"type": "object", "properties": properties},
            },
        }
        for i in range(128)
    ]
    huge = {"messages": [{"role": "user", "content": "call one"}], "tools": tools}
    huge |= {"tool_choice": "required", "max_tokens": 16}
    small = {"messages": [{"role": "user", "content": "Give me a JSON object."}]}
    small |= {"response_format": {"type": "json_object"}, "max_tokens": 24, "temperature": 0}

    def ask(body: dict) -> tuple[int, float]:
        started = time.perf_counter()
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        return reply.status_code, time.perf_counter() - started

    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(ask, [huge] * 5 + [small]))


def load_average() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[0]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


@click.command()
@click.option("--model", default=None, help="GGUF model; default: Gemma 3 270M.")
@click.option("--repetitions", type=int, default=3, help="Times each case runs.")
def main(model: str | None, repetitions: int) -> None:
    model_path = resolve_model(model)
    print(f"CPU: {cpu_name()}; load average {load_average()}; model {model_path.name}")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="bench-grammar-canary-")) / "loomserve.log"
    server = start_loomserve(model_path, port, log)
    try:
        wait_healthy(url, server)
        cases = [*GRAMMARS, "tools"] * repetitions
        for case in cases:
            canary = Canary(url)
            deadline = time.monotonic() + 120
            while canary.tokens() < 5 and not canary.errors and time.monotonic() < deadline:
                time.sleep(0.05)  # streaming before the case starts
            if canary.tokens() < 5:
                raise SystemExit(f"the canary did not stream: {canary.errors}")
            started = time.perf_counter()
            answers = tools_case(url) if case == "tools" else grammar_case(url, GRAMMARS[case])
            ended = time.perf_counter()
            time.sleep(0.5)
            gaps = canary.gaps_between(started, ended)
            stuck = "tick stuck" in log.read_text(errors="replace") or bool(canary.errors)
            statuses = " ".join(f"{status}/{seconds:.1f}s" for status, seconds in answers)
            worst = max(gaps) if gaps else float("nan")
            typical = statistics.median(gaps) if gaps else float("nan")
            print(
                f"{case:8} canary worst gap {worst:.3f} s, median {typical * 1000:.1f} ms over "
                f"{len(gaps)} tokens; {ended - started:.1f} s; answers (status/seconds): "
                f"{statuses}; worker {'STUCK' if stuck else 'up'}",
                flush=True,
            )
            canary.stop.set()
            canary.thread.join(30)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    print(f"load average after: {load_average()}; log: {log}")


if __name__ == "__main__":
    main()
