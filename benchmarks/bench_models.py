"""Several models behind one endpoint: what a cold model costs, and what a second model costs.

1. Cold against warm: `serve` with two models (the same file under two names) and
   --models-max 1, so every switch loads the other model and evicts the idle one. Each round
   times the first token of a streamed request to a model that is not loaded (cold: its
   worker starts, loads the model, the gateway places it) and of the next one (warm).
2. Two models against one: one `serve` of one model under a closed loop of N streams, and
   one `serve` of two models (--models-max 2) under the same total load, half to each,
   alternating rounds; output tokens per second of the whole, by wall clock.

    python -m benchmarks.bench_models --rounds 3
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_spec import free_port, start, stop
from loomserve.cli.bench.session import BenchConfig, LoadShape, run_session
from loomserve.cli.default_model import resolve_model

SLOTS = 16
CTX_PER_SLOT = 512


def serve(models: list[str], port: int, threads: int, extra: list[str]):
    args = [sys.executable, "-m", "loomserve.cli.main", "serve", "--port", str(port)]
    for model in models:
        args += ["--model", model]
    args += ["--slots", str(SLOTS), "--ctx-size", str(CTX_PER_SLOT), "--threads", str(threads)]
    log = Path(tempfile.gettempdir()) / f"bench-models-{port}.log"
    return start([*args, *extra], port, log)


def first_token_seconds(url: str, model: str) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                return time.perf_counter() - started
    raise RuntimeError("no token came")


def wait_unloaded(url: str, model: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        if {c["id"]: c["status"]["value"] for c in cards}.get(model) == "unloaded":
            return
        time.sleep(0.2)
    raise RuntimeError(f"{model} did not unload")


def cold_and_warm(path: Path, rounds: int, threads: int) -> dict[str, list[float]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve([f"chat={path}", f"other={path}"], port, threads, ["--models-max", "1"])
    cold: list[float] = []
    warm: list[float] = []
    try:
        first_token_seconds(url, "chat")  # loaded at start; warms the page cache too
        for _ in range(rounds):
            for model, previous in (("other", "chat"), ("chat", "other")):
                time.sleep(2.5)  # past the eviction grace of the model just loaded
                cold.append(first_token_seconds(url, model))
                warm.append(first_token_seconds(url, model))
                wait_unloaded(url, previous)
    finally:
        stop(proc)
    return {"cold_ttft_s": cold, "warm_ttft_s": warm}


def closed_loop(url: str, model: str, streams: int, prompts: int, seed: int) -> dict:
    config = BenchConfig(
        base_url=url,
        model=model,
        endpoint="completions",
        dataset="random",
        input_len=64,
        output_len=64,
        num_prompts=prompts,
        shape=LoadShape(max_concurrency=streams),
        seed=seed,
        temperature=0.0,
        progress=False,
        num_warmups=0,
        duration_s=600.0,
    )
    return run_session(config, echo=lambda *a, **k: None, warn=lambda *a: None)["summary"]


def loaded(url: str, models: list[str], streams: int, prompts: int, seed: int) -> float:
    """Output tokens per second of the whole load, split evenly over the models."""
    results: list[dict] = []
    share = streams // len(models)

    def run(model: str) -> None:
        results.append(closed_loop(url, model, share, prompts // len(models), seed))

    threads = [threading.Thread(target=run, args=(model,)) for model in models]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return sum(result["total_output_tokens"] for result in results) / wall


def one_against_two(path: Path, rounds: int, threads: int, streams: int) -> dict[str, list]:
    one_port, two_port = free_port(), free_port()
    one = serve([str(path)], one_port, threads, [])
    two = serve([f"chat={path}", f"other={path}"], two_port, threads, ["--models-max", "2"])
    urls = {"one": f"http://127.0.0.1:{one_port}", "two": f"http://127.0.0.1:{two_port}"}
    figures: dict[str, list] = {"one_model_tok_s": [], "two_models_tok_s": []}
    try:
        name = httpx.get(urls["one"] + "/v1/models").json()["data"][0]["id"]
        httpx.post(urls["two"] + "/models/load", json={"model": "other"}, timeout=300)
        for round_ in range(rounds):
            figures["one_model_tok_s"].append(
                loaded(urls["one"], [name], streams, 4 * streams, round_)
            )
            figures["two_models_tok_s"].append(
                loaded(urls["two"], ["chat", "other"], streams, 4 * streams, round_)
            )
    finally:
        stop(one)
        stop(two)
    return figures


@click.command()
@click.option("--model", default=None, help="GGUF file; default Gemma 3 270M.")
@click.option("--rounds", type=int, default=3)
@click.option("--threads", type=int, default=2)
@click.option("--streams", type=int, default=16, help="Concurrent streams of the load test.")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(model: str | None, rounds: int, threads: int, streams: int, json_out: Path | None) -> None:
    path = resolve_model(model)
    figures: dict[str, list] = {**cold_and_warm(path, rounds, threads)}
    figures |= one_against_two(path, rounds, threads, streams)
    for name, values in figures.items():
        print(f"{name:>18}: median {statistics.median(values):8.3f}  all {values}")
    ratio = statistics.median(
        two / one
        for one, two in zip(figures["one_model_tok_s"], figures["two_models_tok_s"], strict=True)
    )
    print(f"two models / one model throughput, median of rounds: {ratio:.2f}x")
    if json_out is not None:
        json_out.write_text(json.dumps({**figures, "two_over_one": ratio}, indent=1))


if __name__ == "__main__":
    main()
