"""`loomserve bench` against the real thing: a worker on the tiny model behind a gateway."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from loomserve.cli.bench.command import bench
from tests.procs import Proc, start_gateway, start_worker


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, slots=4, ctx_size=256) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as proc,
    ):
        yield proc


def run_bench(url: str, out: Path, *args: str) -> dict:
    """Run the command in-process and return its result JSON."""
    common = ["--base-url", url, "--no-progress", "--result-json", str(out), "--save-detailed"]
    outcome = CliRunner().invoke(bench, [*common, *args])
    assert outcome.exit_code == 0, outcome.output
    assert "Serving Benchmark Result" in outcome.output
    return json.loads(out.read_text())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_measures_the_real_server(gateway: Proc, tmp_path: Path, endpoint: str) -> None:
    result = run_bench(
        gateway.url,
        tmp_path / "result.json",
        *("--endpoint", endpoint, "--num-prompts", "12", "--input-len", "32"),
        *("--output-len", "16", "--max-concurrency", "4", "--goodput", "ttft:60000"),
    )
    assert result["settings"]["model"] == "tiny-llama"  # the first of /v1/models
    assert result["settings"]["token_counts"] == "server /tokenize"
    summary = result["summary"]
    assert summary["completed"] == 12 and summary["failed"] == 0, summary["failures"]
    # ignore_eos makes every answer exactly max_tokens long, as the server's usage says.
    assert summary["total_output_tokens"] == 12 * 16
    assert summary["usage_missing"] == 0 and summary["short_outputs"] == 0
    assert summary["max_concurrent_requests"] <= 4
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])
    for key in ("mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms"):
        assert summary[key] > 0
    for request in result["requests"]:
        assert request["prompt_tokens_from_server"]
        assert request["output_tokens"] == 16 and request["chunks"] >= 1
        assert request["e2e_s"] >= request["ttft_s"] > 0
        if endpoint == "completions":  # /tokenize sized it; the server adds BOS
            assert 32 <= request["prompt_tokens"] <= 34


def test_bench_reports_rejections_by_kind(tiny_model_path: Path, tmp_path: Path) -> None:
    # One slot and a queue of one: a burst of eight must see the worker turn some away.
    with (
        start_worker(tiny_model_path, slots=1, max_queue=1, ctx_size=256) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as proc,
    ):
        result = run_bench(
            proc.url,
            tmp_path / "burst.json",
            *("--num-prompts", "8", "--input-len", "16", "--output-len", "64"),
            "--num-warmups",
            "0",
        )
    summary = result["summary"]
    assert summary["failures"].get("http_503", 0) >= 1, summary["failures"]
    assert set(summary["failures"]) == {"http_503"}
    assert summary["completed"] >= 2
    assert summary["completed"] + summary["failed"] == 8
    rejected = [r for r in result["requests"] if r["error_kind"] == "http_503"]
    assert all(r["error"] for r in rejected)  # the server's message, not just a status


def test_bench_samples_loomserves_metrics_and_writes_a_report(
    gateway: Proc, tmp_path: Path
) -> None:
    report = tmp_path / "report.html"
    result = run_bench(
        gateway.url,
        tmp_path / "scraped.json",
        *("--num-prompts", "8", "--input-len", "16", "--output-len", "32"),
        # At 4 req/s the last release comes 2 s in: rates need windows of a second or more,
        # and the tiny model could answer 8 requests sent at once in less.
        *("--request-rate", "4", "--label", "live", "--report", str(report)),
    )
    scraped = result["server_metrics"]  # on by default: the gateway serves /metrics
    assert scraped["server"] == "loomserve" and scraped["errors"] == 0
    assert scraped["sources"]["generation_tokens_per_s"] == "loomserve:generation_tokens_total"
    # The server's own count of the tokens it generated during the run, from its counter's
    # rise between the first and the last sample, is the benchmark's count.
    times, rates = scraped["times_s"], scraped["series"]["generation_tokens_per_s"]
    generated = sum(
        rate * (times[i] - times[i - 1]) for i, rate in enumerate(rates) if rate is not None
    )
    assert generated == pytest.approx(result["summary"]["total_output_tokens"], rel=1e-6)
    assert result["label"] == "live" and result["server"]["model"]["owned_by"] == "loomserve"
    page = report.read_text()
    assert "loomserve:generation_tokens_total" in page and "<script" not in page
