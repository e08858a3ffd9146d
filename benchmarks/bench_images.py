"""Images in beside text streams: loomserve and llama-server --mmproj (issue 58's benchmark).

Each server keeps STREAMS text streams generating (chat, streamed, greedy, `ignore_eos`,
closed loop) for `--phase-seconds`, twice: once alone ("text"), once while image requests
(a chat with one fresh image each, so no encoded-image cache hit) arrive every
`--image-interval` seconds ("images"). The text streams' inter-token gaps are the chunks'
arrival gaps; their p99 in the images phase against the text phase is the ratio issue 58 sets
at most 1.5 for loomserve (llama-server stalls every slot while one slot's image is encoded
and decoded). Each image request's time to first token is timed too, and loomserve's worker
metrics give encode ms and image-pass ms an image. Rounds alternate the servers' order and
the phases' order; the medians over rounds are printed, as a markdown table, and written as
JSON.

The default model is Gemma 3 270M, which has no projector: without `--model`/`--mmproj` the
run generates a text model of its size (tests/tiny_model.py's BENCH_270M) and a random
LLaVA-style projector for it (tests/tiny_vision_model.py, 224x224 images in 14-pixel patches:
256 image tokens). Give a real pair with `--model M.gguf --mmproj mmproj-M.gguf`.

    python -m benchmarks.bench_images --rounds 5
    python -m benchmarks.bench_images --rounds 5 --loomserve-args '--itl-target-ms 100'
    python -m benchmarks.bench_images --rounds 1 --phase-seconds 3 --no-llama-server  # smoke

Run it on a machine nobody else uses.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_spec import free_port, llama_server_cpu_args, start, stop
from tests.tiny_model import BENCH_270M, write_tiny_model
from tests.tiny_vision_model import VisionShape, png_bytes, write_tiny_mmproj

STREAMS = 8
IMAGE_SLOTS = 4  # room for image requests beside the streams
CTX_PER_SLOT = 1024
TEXT_TOKENS = 64  # each text request's answer; the streams start a new one at once
IMAGE_TOKENS = 8  # each image request's answer
BENCH_VISION = VisionShape(
    n_embd_text=BENCH_270M.n_embd,
    n_embd=192,
    n_head=3,
    n_layer=4,
    n_ff=768,
    image_size=224,
    patch_size=14,
    n_mm_hidden=640,
)


@dataclass(slots=True)
class Phase:
    """One phase on one server: the text streams' gaps, the image requests' TTFTs."""

    gaps_ms: list[float] = field(default_factory=list)
    image_ttft_ms: list[float] = field(default_factory=list)
    errors: int = 0
    encode_ms: float | None = None  # loomserve's metrics: per image, this phase
    pass_ms: float | None = None  # of passes of the image's rows alone
    rows_per_pass: float | None = None  # image rows a token pass carried, where they shared one

    def p99_gap(self) -> float | None:
        return percentile(self.gaps_ms, 99)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def cpu_name() -> str:
    """The CPU's model name (what the figures belong to)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def generated_pair(folder: Path) -> tuple[Path, Path]:
    """A text model of Gemma 3 270M's size and a random projector for it."""
    model = write_tiny_model(folder / "bench-270m.gguf", shape=BENCH_270M)
    return model, write_tiny_mmproj(folder / "mmproj-bench-270m.gguf", shape=BENCH_VISION)


def start_loomserve(
    model: Path, mmproj: Path, threads: int, metrics_port: int, extra: list[str]
) -> tuple:
    port = free_port()
    args = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(model)]
    args += ["--mmproj", str(mmproj), "--port", str(port), "--threads", str(threads)]
    args += ["--slots", str(STREAMS + IMAGE_SLOTS), "--ctx-size", str(CTX_PER_SLOT)]
    args += ["--metrics-port", str(metrics_port), *extra]
    log = Path(tempfile.gettempdir()) / f"bench-images-loom-{port}.log"
    return start(args, port, log), f"http://127.0.0.1:{port}"


def start_llama_server(model: Path, mmproj: Path, threads: int, binary: Path) -> tuple:
    port = free_port()
    slots = STREAMS + IMAGE_SLOTS
    args = [str(binary), "-m", str(model), "--mmproj", str(mmproj), "--port", str(port)]
    args += ["--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads), "-np", str(slots)]
    args += ["-c", str(slots * CTX_PER_SLOT), "--no-webui", *llama_server_cpu_args()]
    log = Path(tempfile.gettempdir()) / f"bench-images-llama-{port}.log"
    return start(args, port, log), f"http://127.0.0.1:{port}"


MODEL_NAME = ["bench"]  # the model's file stem, as loomserve serves it (set in main)


def chat_body(content: object, max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME[0],
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def stream_chat(client: httpx.Client, url: str, body: dict) -> list[float]:
    """The arrival times of a streamed chat's content chunks (empty on an error)."""
    times = []
    with client.stream("POST", url + "/v1/chat/completions", json=body) as answer:
        if answer.status_code != 200:
            answer.read()
            return []
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
    return times


def new_client() -> httpx.Client:
    """A client that opens a connection a request: llama-server drops a kept-alive one now and
    then ("Server disconnected without sending a response"), which cost its streams a retry."""
    return httpx.Client(timeout=120, limits=httpx.Limits(max_keepalive_connections=0))


def text_stream(url: str, index: int, until: float, phase: Phase, lock: threading.Lock) -> None:
    """One closed-loop text stream until `until`: its gaps between chunks."""
    prompt = f"stream {index}: tell me a long story about the river and the house"
    with new_client() as client:
        while time.perf_counter() < until:
            try:
                times = stream_chat(client, url, chat_body(prompt, TEXT_TOKENS))
            except httpx.HTTPError:  # a dropped connection counts as an error, not the end
                times = []
            with lock:
                phase.gaps_ms += [1000 * (b - a) for a, b in itertools.pairwise(times)]
                phase.errors += not times
            if not times:
                time.sleep(0.5)  # a failing server is not hammered


def image_request(url: str, image: bytes, phase: Phase, lock: threading.Lock) -> None:
    data = base64.b64encode(image).decode()
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
        {"type": "text", "text": "what is in the picture?"},
    ]
    with new_client() as client:
        sent = time.perf_counter()
        try:
            times = stream_chat(client, url, chat_body(content, IMAGE_TOKENS))
        except httpx.HTTPError:
            times = []
    with lock:
        if times:
            phase.image_ttft_ms.append(1000 * (times[0] - sent))
        else:
            phase.errors += 1


def run_phase(
    url: str, seconds: float, interval: float | None, image_side: int, seed: int
) -> Phase:
    """The text streams for `seconds`, with image requests every `interval` s if given."""
    phase, lock = Phase(), threading.Lock()
    until = time.perf_counter() + seconds
    workers = [
        threading.Thread(target=text_stream, args=(url, i, until, phase, lock))
        for i in range(STREAMS)
    ]
    for worker in workers:
        worker.start()
    time.sleep(min(1.0, seconds / 4))  # the streams are generating before images arrive
    sent = 0
    while interval is not None and time.perf_counter() < until:
        image = png_bytes(image_side, image_side, seed=seed * 10_000 + sent)  # never cached
        worker = threading.Thread(target=image_request, args=(url, image, phase, lock))
        worker.start()
        workers.append(worker)
        sent += 1
        time.sleep(interval)
    for worker in workers:
        worker.join()
    return phase


def image_metrics(metrics_url: str | None) -> dict[str, float]:
    """loomserve's worker counters of images (zeros without a metrics URL)."""
    names = (
        "images",
        "image_encode_seconds",
        "image_passes",
        "image_pass_seconds",
        "image_rows_in_token_passes",
        "image_token_passes",
    )
    found = dict.fromkeys(names, 0.0)
    if metrics_url is None:
        return found
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        for name in names:
            if line.startswith(f"loomserve:{name}_total "):
                found[name] = float(line.split()[-1])
    return found


def per_image_ms(before: dict[str, float], after: dict[str, float]) -> tuple:
    images = after["images"] - before["images"]
    passes = after["image_passes"] - before["image_passes"]
    encode = after["image_encode_seconds"] - before["image_encode_seconds"]
    passed = after["image_pass_seconds"] - before["image_pass_seconds"]
    rows = after["image_rows_in_token_passes"] - before["image_rows_in_token_passes"]
    shared = after["image_token_passes"] - before["image_token_passes"]
    return (
        1000 * encode / images if images else None,
        1000 * passed / images if passes and images else None,
        rows / shared if shared else None,
    )


def median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def shown(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(phases: dict[str, list[Phase]], servers: list[str]) -> list[str]:
    """The markdown table: medians over rounds of each phase's figures."""
    lines = [
        "| server | text p99 ITL ms | with images p99 ITL ms | ratio | image TTFT p50 ms "
        "| image TTFT p99 ms | encode ms/image | image pass ms/image | image rows/token pass "
        "| errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for server in servers:
        text, images = phases[f"{server}|text"], phases[f"{server}|images"]
        quiet = median_of([p.p99_gap() for p in text])
        busy = median_of([p.p99_gap() for p in images])
        ratio = busy / quiet if busy is not None and quiet else None
        ttft50 = median_of([percentile(p.image_ttft_ms, 50) for p in images])
        ttft99 = median_of([percentile(p.image_ttft_ms, 99) for p in images])
        encode = median_of([p.encode_ms for p in images])
        passed = median_of([p.pass_ms for p in images])
        shared = median_of([p.rows_per_pass for p in images])
        errors = sum(p.errors for p in text + images)
        lines.append(
            f"| {server} | {shown(quiet)} | {shown(busy)} | {shown(ratio, 2)} | {shown(ttft50)} "
            f"| {shown(ttft99)} | {shown(encode)} | {shown(passed)} | {shown(shared)} | {errors} |"
        )
    return lines


@click.command()
@click.option("--model", type=click.Path(path_type=Path), default=None, help="Text model GGUF.")
@click.option("--mmproj", type=click.Path(path_type=Path), default=None, help="Its projector.")
@click.option("--rounds", type=int, default=3, help="Rounds; each runs every server and phase.")
@click.option("--phase-seconds", type=float, default=20.0, help="Length of each phase.")
@click.option("--image-interval", type=float, default=1.0, help="Seconds between images.")
@click.option("--image-side", type=int, default=224, help="The images' width and height.")
@click.option("--threads", type=int, default=4, help="Each server's threads.")
@click.option(
    "--llama-server",
    "binary",
    type=click.Path(path_type=Path),
    default=lambda: os.environ.get("LOOMSERVE_LLAMA_SERVER"),
    help="llama-server's binary (default: $LOOMSERVE_LLAMA_SERVER).",
)
@click.option("--no-llama-server", is_flag=True, help="loomserve only.")
@click.option(
    "--loomserve-args",
    default="",
    help="More options for `loomserve serve`, e.g. '--itl-target-ms 100'.",
)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(
    model: Path | None,
    mmproj: Path | None,
    rounds: int,
    phase_seconds: float,
    image_interval: float,
    image_side: int,
    threads: int,
    binary: Path | None,
    no_llama_server: bool,
    loomserve_args: str,
    json_out: Path | None,
) -> None:
    """Every server through both phases, `rounds` times, alternating; the medians."""
    if (model is None) != (mmproj is None):
        raise click.UsageError("give --model and --mmproj together (or neither: generated)")
    workdir = Path(tempfile.mkdtemp(prefix="bench-images-"))
    if model is None or mmproj is None:
        model, mmproj = generated_pair(workdir)
    MODEL_NAME[0] = model.stem
    metrics_port = free_port()
    procs: list[subprocess.Popen] = []
    servers: dict[str, str] = {}
    metrics: dict[str, str | None] = {}
    phases: dict[str, list[Phase]] = {}
    try:
        extra = shlex.split(loomserve_args)
        proc, servers["loomserve"] = start_loomserve(model, mmproj, threads, metrics_port, extra)
        procs.append(proc)
        metrics["loomserve"] = f"http://127.0.0.1:{metrics_port}/metrics"
        if not no_llama_server and binary is not None and Path(binary).exists():
            proc, servers["llama-server"] = start_llama_server(model, mmproj, threads, binary)
            procs.append(proc)
            metrics["llama-server"] = None
        else:
            click.echo("no llama-server (LOOMSERVE_LLAMA_SERVER): loomserve only", err=True)
        names = list(servers)
        for round_ in range(rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            kinds = ("text", "images") if round_ % 2 == 0 else ("images", "text")
            for server in order:
                for kind in kinds:
                    before = image_metrics(metrics[server])
                    interval = image_interval if kind == "images" else None
                    phase = run_phase(servers[server], phase_seconds, interval, image_side, round_)
                    phase.encode_ms, phase.pass_ms, phase.rows_per_pass = per_image_ms(
                        before, image_metrics(metrics[server])
                    )
                    phases.setdefault(f"{server}|{kind}", []).append(phase)
                    click.echo(
                        f"round {round_ + 1} {server} {kind}: p99 ITL "
                        f"{shown(phase.p99_gap())} ms, {len(phase.image_ttft_ms)} images, "
                        f"{phase.errors} errors",
                        err=True,
                    )
    finally:
        for proc in procs:
            stop(proc)
    click.echo(
        f"\n{model.name} + {mmproj.name}, {cpu_name()}, {os.cpu_count()} CPUs, {threads} "
        f"threads, {STREAMS} text streams, an image every {image_interval:g} s "
        f"({image_side}x{image_side}), {rounds} round(s) of {phase_seconds:g} s phases; "
        f"logs in {tempfile.gettempdir()}"
    )
    for line in report(phases, names):
        click.echo(line)
    if json_out:
        as_dicts = {key: [asdict(phase) for phase in got] for key, got in phases.items()}
        json_out.write_text(json.dumps({"cpu": cpu_name(), "phases": as_dicts}, indent=2))


if __name__ == "__main__":
    main()
