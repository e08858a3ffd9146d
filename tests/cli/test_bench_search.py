"""--find: bracket and bisect to the most load within the SLOs, on a model and on a fake server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from loomserve.cli.bench.command import bench
from loomserve.cli.bench.search import (
    ProbeOutcome,
    SearchResult,
    find_limit,
    format_answer,
    search_dict,
    wilson_interval,
)
from tests.cli.fake_openai import FakeOpenAI, serve_fake


def capacity_model(limit: float, total: int = 100, delay_s: float = 0.0):
    """A probe whose attainment is 100 % up to limit and 50 % past it."""
    calls: list[float] = []

    async def probe(value: float, index: int) -> ProbeOutcome:
        calls.append(value)
        if delay_s:
            await asyncio.sleep(delay_s)
        met = total if value <= limit else total // 2
        return ProbeOutcome(value=value, met=met, total=total, seconds=delay_s)

    return probe, calls


def search(mode: str, probe, start: float, budget_s: float = 60.0, precision: float = 0.1):
    lines: list[str] = []
    result = asyncio.run(find_limit(mode, probe, start, 0.9, precision, budget_s, lines.append))
    return result, lines


@pytest.mark.parametrize("start", [0.5, 3.0, 40.0])
def test_max_rate_is_found_within_the_precision_from_any_start(start: float) -> None:
    probe, calls = capacity_model(7.3)
    result, lines = search("max-rate", probe, start)
    assert result.stopped == "converged"
    assert result.best is not None and result.worst is not None
    assert result.best.value <= 7.3 < result.worst.value
    assert result.worst.value - result.best.value <= 0.1 * result.best.value
    assert len(lines) == len(calls) == len(result.probes) < 15  # one line per probe
    assert all(line.startswith(f"probe {i + 1}: ") for i, line in enumerate(lines))
    assert "Max request rate meeting 90% of requests within every SLO" in format_answer(result)


def test_max_concurrency_settles_on_a_whole_number() -> None:
    probe, calls = capacity_model(11)
    result, _ = search("max-concurrency", probe, 1)
    assert result.best is not None and result.worst is not None
    assert (result.best.value, result.worst.value) == (11, 12)
    assert all(float(v).is_integer() for v in calls)
    assert calls[:5] == [1, 2, 4, 8, 16]  # bracketed by doubling


def test_no_passing_value_and_a_limit_never_reached_are_said() -> None:
    probe, _ = capacity_model(0.001)
    result, _ = search("max-rate", probe, 1.0)
    assert result.best is None and result.stopped == "no passing value"
    assert format_answer(result).startswith("No request rate tried meets")
    probe, _ = capacity_model(1e9)
    result, _ = search("max-concurrency", probe, 1)
    assert result.worst is None and result.stopped == "never failed"


def test_the_search_stops_by_itself_when_its_time_is_up() -> None:
    probe, calls = capacity_model(7.3, delay_s=0.2)
    started = time.monotonic()
    result, _ = search("max-rate", probe, 1.0, budget_s=0.5)
    assert time.monotonic() - started < 0.5 + 0.2 + 0.5  # at most the probe that was running
    assert result.stopped == "budget" and 1 <= len(calls) <= 4
    assert "[stopped: budget]" in format_answer(result) or result.best is None


def test_the_answer_carries_a_wilson_interval() -> None:
    low, high = wilson_interval(45, 50)
    assert 0.78 < low < 0.9 < high < 0.97  # the textbook values: 0.786, 0.957
    result = SearchResult("max-rate", 0.9, 0.1)
    result.best = ProbeOutcome(4.0, 45, 50, 1.0)
    result.probes = [result.best]
    answer = search_dict(result)["answer"]
    assert answer["value"] == 4.0 and answer["attainment_ci95"] == pytest.approx([low, high])


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeOpenAI, str]]:
    with serve_fake() as served:
        yield served


def test_cli_finds_the_fake_servers_limit(fake, tmp_path) -> None:
    server, url = fake
    server.reset()
    server.capacity = 2  # two at a time, 140 ms each: about 14 req/s at most
    out = tmp_path / "search.json"
    args = ["--base-url", url, "--num-prompts", "12", "--input-len", "4", "--output-len", "3"]
    args += ["--find", "max-rate", "--goodput", "ttft:400", "--attainment", "90"]
    args += ["--request-rate", "4", "--find-precision", "0.3", "--duration", "60"]
    args += ["--num-warmups", "0", "--no-progress", "--result-json", str(out)]
    started = time.monotonic()
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert time.monotonic() - started < 60
    assert "probe 1: 4 req/s -> attainment" in outcome.output
    assert "Max request rate meeting 90% of requests" in outcome.output
    search = json.loads(out.read_text())["search"]
    assert search["mode"] == "max-rate" and search["stopped"] == "converged"
    answer = search["answer"]
    passed = [p["value"] for p in search["probes"] if p["passed"]]
    failed = [p["value"] for p in search["probes"] if not p["passed"]]
    assert answer["value"] == max(passed) and answer["fails_at"] == min(failed)
    assert answer["value"] < answer["fails_at"] <= 1.3 * answer["value"] + 1e-9
    # Requests queued behind two slots wait: far past the fake's capacity, TTFT breaks 400 ms.
    assert answer["fails_at"] <= 64
    assert all("summary" in p and "attainment" in p for p in search["probes"])


def test_find_needs_slos() -> None:
    outcome = CliRunner().invoke(bench, ["--find", "max-rate", "--base-url", "http://127.0.0.1:9"])
    assert outcome.exit_code == 2 and "--find needs SLOs" in outcome.output
