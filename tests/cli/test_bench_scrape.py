"""--scrape-metrics: the server's Prometheus series sampled during a run, by each server's names."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from loomserve.cli.bench.command import bench
from loomserve.cli.bench.scrape import (
    AT_REQUEST_END,
    MIN_RATE_WINDOW_S,
    Timeline,
    parse_sample,
    rate_windows,
    server_kind,
)
from loomserve.gateway.metrics import GatewayMetrics
from tests.cli.fake_openai import FakeOpenAI, serve_fake

LLAMA_SERVER = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1200
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 340
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.25
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def loomserve_text(generated: float) -> str:
    """The worker's gauges in loomserve's own names, two workers apart (labels summed)."""
    registry = CollectorRegistry()
    waiting = Gauge("loomserve:num_requests_waiting", "w", ["worker"], registry=registry)
    running = Gauge("loomserve:num_requests_running", "r", ["worker"], registry=registry)
    tokens = Counter("loomserve:generation_tokens", "g", registry=registry)
    for worker, n in (("a", 2), ("b", 3)):
        waiting.labels(worker).set(n)
        running.labels(worker).set(n + 1)
    tokens.inc(generated)
    return generate_latest(registry).decode()


def test_each_servers_names_are_read() -> None:
    llama = parse_sample(LLAMA_SERVER)
    assert llama["llamacpp:requests_processing"] == 3
    assert llama["llamacpp:tokens_predicted_total"] == 340
    assert server_kind(llama) == "llama-server"
    loom = parse_sample(loomserve_text(10))
    assert loom["loomserve:num_requests_waiting"] == 5  # summed over the workers
    assert loom["loomserve:generation_tokens_total"] == 10
    assert server_kind(loom) == "loomserve"
    assert parse_sample("unrelated_metric 1\n") == {}


def test_counters_become_rates_and_gauges_stay_values() -> None:
    timeline = Timeline(
        times_s=[0.0, 1.0, 3.0],
        samples=[parse_sample(loomserve_text(n)) for n in (0, 50, 250)],
    )
    series = timeline.series()
    assert series["server"] == "loomserve"
    assert series["series"]["generation_tokens_per_s"] == [None, 50.0, 100.0]
    assert series["series"]["waiting"] == [5, 5, 5]
    assert series["sources"]["running"] == "loomserve:num_requests_running"
    assert "kv_cache_usage" not in series["series"]  # not exposed: not invented


def test_no_rate_is_taken_over_less_than_a_second() -> None:
    """Issue 60: the sample at the run's end came 0.05 s after the last tick, and the tokens
    counted in between made a ~1,350 tok/s spike out of a ~20 tok/s run."""
    times = [0.0, 1.0, 2.0, 2.05]
    timeline = Timeline(times, [parse_sample(loomserve_text(n)) for n in (0, 20, 40, 108)])
    rates = timeline.series()["series"]["generation_tokens_per_s"]
    assert rates[0] is None and rates[1] == 20.0
    assert rates[2] == rates[3] == pytest.approx(88 / 1.05)  # one window, 1.0 to 2.05 s
    generated = sum(r * (times[i] - times[i - 1]) for i, r in enumerate(rates) if r is not None)
    assert generated == pytest.approx(108)  # still adds up to the counter's rise
    assert rate_windows([0.0, 0.4, 0.8, 1.3, 1.7, 2.9]) == [0, 3, 5]
    assert rate_windows([0.0, 0.3, 0.6]) == [0]  # under a second in all: no rate at all
    ends = rate_windows(times)
    assert all(times[b] - times[a] >= MIN_RATE_WINDOW_S for a, b in itertools.pairwise(ends))


def gateway_text(generated: int, kv: tuple[float, float]) -> str:
    """The gateway's own /metrics, two workers' heartbeats in it."""
    metrics = GatewayMetrics()
    metrics.requests_in_flight.labels("tiny").set(3)
    for worker, usage in zip(("ipc:///a", "ipc:///b"), kv, strict=True):
        metrics.set_worker_load(worker, running=2, waiting=1, free_slots=0, kv_usage=usage)
    metrics.generation_tokens.labels("tiny").inc(generated)
    metrics.prompt_tokens.labels("tiny").inc(4 * generated)
    return metrics.render()[0].decode()


def test_the_gateways_worker_gauges_are_read_and_its_end_counted_tokens_said() -> None:
    """Against `serve`, the gateway's /metrics carries each worker's heartbeat load
    (loomserve:worker_*): waiting and KV come from there, and its token counters, raised
    when a request ends, are named as such."""
    samples = [parse_sample(gateway_text(n, (0.2, 0.4))) for n in (0, 30, 90)]
    series = Timeline([0.0, 1.0, 2.0], samples).series()
    assert series["sources"]["waiting"] == "loomserve:worker_num_requests_waiting"
    assert series["sources"]["running"] == "loomserve:worker_num_requests_running"
    assert series["sources"]["kv_cache_usage"] == "loomserve:worker_kv_cache_usage_perc"
    assert series["series"]["waiting"] == [2, 2, 2]  # summed over the two workers
    assert series["series"]["kv_cache_usage"] == pytest.approx([0.3] * 3)  # a share: averaged
    assert series["notes"]["generation_tokens_per_s"] == AT_REQUEST_END
    assert series["notes"]["prompt_tokens_per_s"] == AT_REQUEST_END
    # The worker's own port counts generated tokens each tick: no note there.
    worker = Timeline([0.0, 1.0], [parse_sample(loomserve_text(n)) for n in (0, 5)]).series()
    assert "generation_tokens_per_s" not in worker["notes"]


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeOpenAI, str]]:
    with serve_fake() as served:
        yield served


def test_a_run_against_a_server_with_metrics_samples_them(fake, tmp_path) -> None:
    server, url = fake
    server.reset()
    server.metrics = True
    out = tmp_path / "result.json"
    args = ["--base-url", url, "--num-prompts", "6", "--input-len", "4", "--output-len", "60"]
    args += ["--max-concurrency", "3", "--num-warmups", "0", "--no-progress"]
    args += ["--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)  # on by default: the target has /metrics
    assert outcome.exit_code == 0, outcome.output
    assert "Sampling" in outcome.output
    scraped = json.loads(out.read_text())["server_metrics"]
    assert scraped["server"] == "vllm" and scraped["errors"] == 0
    assert len(scraped["times_s"]) >= 3  # about 2.5 s of run, once a second, and at the end
    running = scraped["series"]["running"]
    assert max(running) <= 3 and max(running) >= 1  # the fake saw the benchmark's requests
    rates = [r for r in scraped["series"]["generation_tokens_per_s"] if r is not None]
    assert rates and max(rates) > 0
    assert sum(r is not None for r in scraped["series"]["kv_cache_usage"]) == len(running)


def test_no_metrics_endpoint_means_no_sampling_and_asking_warns(fake, tmp_path) -> None:
    server, url = fake
    server.reset()
    out = tmp_path / "result.json"
    args = ["--base-url", url, "--num-prompts", "2", "--input-len", "4", "--output-len", "2"]
    args += ["--num-warmups", "0", "--no-progress", "--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert "server_metrics" not in json.loads(out.read_text())
    outcome = CliRunner().invoke(bench, [*args, "--scrape-metrics"])
    assert outcome.exit_code == 0, outcome.output
    assert "answered HTTP 404: the server has no metrics" in outcome.output
    assert "the run goes on without server metrics" in outcome.output
