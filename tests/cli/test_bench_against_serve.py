"""`loomserve bench` against `loomserve serve` on the tiny model: what it samples from the
gateway's /metrics (the workers' heartbeat gauges, the token counters raised at each request's
end), and who it says it measured (the model benchmarked, loomserve's version)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from loomserve.cli.bench.command import bench
from loomserve.cli.bench.scrape import AT_REQUEST_END, MIN_RATE_WINDOW_S
from tests.cli.test_cli import ROOT, clean_env
from tests.procs import free_port


@pytest.fixture(scope="module")
def serve(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`loomserve serve` (a gateway and one worker of 2 slots) on a free loopback port."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(tiny_model_path)]
    argv += ["--port", str(port), "--slots", "2", "--ctx-size", "256"]
    argv += ["--heartbeat-interval", "0.25"]
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, cwd=ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=2).json().get("workers_ready") == 1:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def test_bench_reads_the_gateways_worker_gauges_and_says_what_its_counters_are(
    serve: str, tmp_path: Path
) -> None:
    out, report = tmp_path / "result.json", tmp_path / "report.html"
    args = ["--base-url", serve, "--model", "tiny-llama", "--num-prompts", "8"]
    # 8 requests at 4 req/s: the schedule's last release comes 2 s after the start, so the
    # run spans two one-second rate windows however fast the tiny model answers.
    args += ["--input-len", "16", "--output-len", "32", "--request-rate", "4"]
    args += ["--no-progress", "--scrape-metrics"]  # the warm-up starts the counters
    args += ["--result-json", str(out), "--report", str(report)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(out.read_text())
    scraped = result["server_metrics"]
    assert scraped["server"] == "loomserve" and scraped["errors"] == 0
    # The worker's heartbeat load, as the gateway's /metrics carries it: no --metrics-port.
    assert scraped["sources"]["waiting"] == "loomserve:worker_num_requests_waiting"
    assert scraped["sources"]["running"] == "loomserve:worker_num_requests_running"
    assert scraped["sources"]["kv_cache_usage"] == "loomserve:worker_kv_cache_usage_perc"
    assert max(scraped["series"]["running"]) <= 2
    assert all(0.0 <= v <= 1.0 for v in scraped["series"]["kv_cache_usage"])
    # The gateway counts a request's tokens when it ends: said, in the JSON and the report.
    assert scraped["notes"]["generation_tokens_per_s"] == AT_REQUEST_END
    assert AT_REQUEST_END in report.read_text()
    # No rate over less than a second: a sample closer than that shares its window's rate.
    times, rates = scraped["times_s"], scraped["series"]["generation_tokens_per_s"]
    window_start = 0
    for i in range(1, len(times)):
        if rates[i] is not None and i + 1 < len(times) and rates[i + 1] == rates[i]:
            continue  # the window goes on
        if rates[i] is not None:
            assert times[i] - times[window_start] >= MIN_RATE_WINDOW_S, (times, rates)
        window_start = i
    assert sum(r is not None for r in rates) >= 2
    generated = sum(r * (times[i] - times[i - 1]) for i, r in enumerate(rates) if r is not None)
    assert generated == pytest.approx(result["summary"]["total_output_tokens"], rel=1e-6)
    # Who was measured: the model asked for, and loomserve's own version.
    assert result["server"]["model"]["id"] == "tiny-llama"
    assert result["server"]["loomserve_version"] == importlib.metadata.version("loomserve")
