"""Soak test: `loomserve serve` under steady streaming load, with cancellations and kills.

It starts `loomserve serve`, takes a greedy reference text for each of a few prompts, then for
--duration seconds keeps --concurrency streaming clients busy; a --cancel-rate fraction of them
hang up mid-stream, and every --kill-interval seconds the worker or a gateway (in turn) is
SIGKILLed for the supervisor to restart. It reports

  - leaks: RSS and open-FD slopes of the worker and the gateways (per hour, fitted over each
    process's lifetime between kills), and the slots, queue and KV cells left once idle;
  - corruption: completed streams whose text differs from the reference (a duplicated,
    dropped or reordered token shows here), and cancelled ones whose text is not a prefix;
  - recovery: seconds from each kill until a request succeeds again;
  - errors: statuses and stream error events, inside a kill's recovery window and outside.

    python -m benchmarks.soak --duration 1800 --concurrency 8 --cancel-rate 0.2 \\
        --kill-interval 120 --report soak.json

Without --model it runs on the generated tiny test model (fast: it exercises the serving
machinery, not llama.cpp). Not a test: on a shared machine read the numbers as a trend.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.procfs import processes

PROMPTS = [
    "once upon a time",
    "the quick brown fox",
    "in the beginning",
    "hello world",
    "a b c d e f",
    "it was a dark and stormy night",
    "call me ishmael",
    "to be or not to be",
]
SAMPLE_SECONDS = 5.0
RECOVERY_GRACE = 2.0  # errors this long after a recovery still count as the kill's


@dataclass(slots=True)
class Tally:
    """What the clients saw."""

    completed: int = 0
    cancelled: int = 0
    mismatched: int = 0  # completed, text differs from the reference
    bad_prefix: int = 0  # cancelled, text is not a prefix of the reference
    errors_in_kill_window: dict[str, int] = field(default_factory=dict)
    errors_outside: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Sample:
    t: float
    role: str
    pid: int
    rss_mib: float
    fds: int


def children_of(pid: int) -> dict[int, str]:
    """Direct children of pid: {pid: 'worker' | 'gateway'}, from /proc."""
    found = {}
    for process in processes():
        if process.parent != pid:
            continue
        if "worker" in process.command:
            found[process.pid] = "worker"
        elif "gateway" in process.command:
            found[process.pid] = "gateway"
    return found


def measure(pid: int) -> tuple[float, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss_kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return rss_kib / 1024, fds


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value), per hour."""
    if len(points) < 3:
        return 0.0
    return statistics.linear_regression(*zip(*points, strict=True)).slope * 3600


class Soak:
    def __init__(self, url: str, serve: subprocess.Popen, opts: dict) -> None:
        self.url = url
        self.serve = serve
        self.opts = opts
        self.tally = Tally()
        self.samples: list[Sample] = []
        self.references: dict[str, str] = {}
        self.kills: list[dict] = []
        self.windows: list[tuple[float, float]] = []  # [kill, recovered + grace]
        self.in_kill = False
        self.rng = random.Random(opts["seed"])
        self.stop_at = 0.0

    def body(self, prompt: str, stream: bool) -> dict:
        return {
            "prompt": prompt,
            "max_tokens": self.opts["max_tokens"],
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }

    async def take_references(self, client: httpx.AsyncClient) -> None:
        for prompt in PROMPTS:
            response = await client.post(self.url, json=self.body(prompt, False), timeout=60)
            response.raise_for_status()
            self.references[prompt] = response.json()["choices"][0]["text"]

    def error(self, kind: str, detail: str) -> None:
        now = time.monotonic()
        near = self.in_kill or any(a <= now <= b for a, b in self.windows)
        bucket = self.tally.errors_in_kill_window if near else self.tally.errors_outside
        bucket[kind] = bucket.get(kind, 0) + 1
        if not near and len(self.tally.examples) < 20:
            self.tally.examples.append(f"{kind}: {detail[:200]}")

    async def client_loop(self, client: httpx.AsyncClient) -> None:
        while time.monotonic() < self.stop_at:
            prompt = self.rng.choice(PROMPTS)
            cancel_after = None
            if self.rng.random() < self.opts["cancel_rate"]:
                cancel_after = self.rng.randrange(1, self.opts["max_tokens"])
            try:
                await self.one_stream(client, prompt, cancel_after)
            except httpx.HTTPError as exc:
                self.error(f"http {type(exc).__name__}", str(exc))
                await asyncio.sleep(0.2)

    async def one_stream(self, client: httpx.AsyncClient, prompt: str, cancel_after: int | None):
        text, chunks = [], 0
        async with client.stream("POST", self.url, json=self.body(prompt, True)) as response:
            if response.status_code != 200:
                await response.aread()
                self.error(f"status {response.status_code}", response.text)
                await asyncio.sleep(0.2)
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    self.error(f"event {event['error'].get('code')}", event["error"]["message"])
                    return
                text.append(event["choices"][0]["text"])
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    break  # leaving the block closes the connection: a cancel
        got, want = "".join(text), self.references[prompt]
        if cancel_after is not None and chunks >= cancel_after:
            self.tally.cancelled += 1
            if not want.startswith(got):
                self.tally.bad_prefix += 1
                self.tally.examples.append(f"bad prefix: {got[:80]!r} vs {want[:80]!r}")
        else:
            self.tally.completed += 1
            if got != want:
                self.tally.mismatched += 1
                self.tally.examples.append(f"mismatch: {got[:80]!r} vs {want[:80]!r}")

    async def sampler(self) -> None:
        start = time.monotonic()
        while time.monotonic() < self.stop_at + 10:
            for pid, role in children_of(self.serve.pid).items():
                measured = measure(pid)
                if measured:
                    self.samples.append(Sample(time.monotonic() - start, role, pid, *measured))
            await asyncio.sleep(SAMPLE_SECONDS)

    async def killer(self, client: httpx.AsyncClient) -> None:
        interval = self.opts["kill_interval"]
        if not interval:
            return
        victims = ["worker", "gateway"]
        turn = 0
        while True:
            await asyncio.sleep(interval)
            if time.monotonic() + 30 > self.stop_at:
                return
            role = victims[turn % 2]
            turn += 1
            pids = [p for p, r in children_of(self.serve.pid).items() if r == role]
            if not pids:
                continue
            pid = self.rng.choice(pids)
            self.in_kill = True
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            recovered = await self.wait_recovered(client)
            self.in_kill = False
            seconds = recovered - killed
            self.windows.append((killed, recovered + RECOVERY_GRACE))
            self.kills.append({"role": role, "pid": pid, "recovery_s": round(seconds, 2)})
            print(f"killed {role} {pid}: recovered in {seconds:.2f}s", flush=True)

    async def wait_recovered(self, client: httpx.AsyncClient) -> float:
        body = {"prompt": "hi", "max_tokens": 1}
        while True:
            await asyncio.sleep(0.1)
            try:
                response = await client.post(self.url, json=body, timeout=5)
                if response.status_code == 200:
                    return time.monotonic()
            except httpx.HTTPError:
                pass

    async def idle_state(self, client: httpx.AsyncClient, metrics_url: str) -> dict:
        await asyncio.sleep(8)  # past the gateway timeout: every cancel has landed
        health = (await client.get(self.url.replace("/v1/completions", "/health"))).json()
        metrics = (await client.get(metrics_url)).text
        values = {}
        for line in metrics.splitlines():
            for name in (
                "free_slots",
                "num_requests_running",
                "num_requests_waiting",
                "kv_cache_cells_used",
            ):
                if line.startswith(f"loomserve:{name} "):
                    values[name] = float(line.split()[1])
        return {"health": health, "worker_metrics": values}

    def leak_report(self) -> dict:
        report = {}
        for role in ("worker", "gateway"):
            segments: dict[int, list[Sample]] = {}
            for s in self.samples:
                if s.role == role:
                    segments.setdefault(s.pid, []).append(s)
            long = [seg for seg in segments.values() if seg[-1].t - seg[0].t >= 120]
            # Skip each process's first minute: warm-up allocations are not a leak.
            fits = [[s for s in seg if s.t - seg[0].t >= 60] for seg in long]
            report[role] = {
                "processes": len(segments),
                "rss_mib_per_hour": [
                    round(slope_per_hour([(s.t, s.rss_mib) for s in f]), 2) for f in fits
                ],
                "fds_per_hour": [round(slope_per_hour([(s.t, s.fds) for s in f]), 2) for f in fits],
                "rss_mib_last": [round(seg[-1].rss_mib, 1) for seg in segments.values()][-3:],
                "fds_last": [seg[-1].fds for seg in segments.values()][-3:],
            }
        return report

    async def run(self, metrics_url: str) -> dict:
        limits = httpx.Limits(max_connections=self.opts["concurrency"] + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await self.take_references(client)
            self.stop_at = time.monotonic() + self.opts["duration"]
            sampler = asyncio.create_task(self.sampler())
            killer = asyncio.create_task(self.killer(client))
            clients = [self.client_loop(client) for _ in range(self.opts["concurrency"])]
            await asyncio.gather(*clients)
            killer.cancel()
            idle = await self.idle_state(client, metrics_url)
            await sampler
        recoveries = [k["recovery_s"] for k in self.kills]
        return {
            "settings": self.opts,
            "tally": asdict(self.tally),
            "kills": self.kills,
            "recovery_s": {
                "count": len(recoveries),
                "median": statistics.median(recoveries) if recoveries else None,
                "max": max(recoveries) if recoveries else None,
            },
            "leaks": self.leak_report(),
            "idle": idle,
        }


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@click.command()
@click.option("--duration", type=float, default=1800.0, show_default=True, help="Seconds of load.")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Streaming clients.")
@click.option(
    "--cancel-rate", type=float, default=0.2, show_default=True, help="Share hung up mid-stream."
)
@click.option(
    "--kill-interval",
    type=float,
    default=120.0,
    show_default=True,
    help="Seconds between SIGKILLs of the worker or a gateway, in turn; 0: never.",
)
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--gateways", type=int, default=2, show_default=True)
@click.option("--slots", type=int, default=4, show_default=True)
@click.option("--model", type=click.Path(dir_okay=False), default=None, help="Default: tiny.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--report", type=click.Path(dir_okay=False), default=None, help="JSON report path.")
def main(**opts) -> None:
    """Soak `loomserve serve` and report leaks, corruption and recovery."""
    workdir = Path(tempfile.mkdtemp(prefix="loomserve-soak-"))
    model = opts["model"]
    if model is None:
        from tests.tiny_model import write_tiny_model

        model = str(write_tiny_model(workdir / "tiny.gguf"))
    port, metrics_port = free_port(), free_port()
    log = (workdir / "serve.log").open("wb")
    serve = subprocess.Popen(
        [
            *(sys.executable, "-m", "loomserve.cli.main", "serve", "--model", model),
            *("--port", str(port), "--gateways", str(opts["gateways"])),
            *("--slots", str(opts["slots"]), "--ctx-size", "512", "--threads", "1"),
            *("--metrics-port", str(metrics_port), "--no-log-json", "--log-level", "warning"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or serve.poll() is not None:
                raise SystemExit(f"serve did not come up; see {workdir / 'serve.log'}")
            time.sleep(0.2)
        soak = Soak(url, serve, opts)
        report = asyncio.run(soak.run(f"http://127.0.0.1:{metrics_port}/metrics"))
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            report_exit = serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()
            report_exit = serve.wait()
    report["serve_exit_status"] = report_exit
    report["serve_log"] = str(workdir / "serve.log")
    text = json.dumps(report, indent=2)
    print(text)
    if opts["report"]:
        Path(opts["report"]).write_text(text)


if __name__ == "__main__":
    main()
