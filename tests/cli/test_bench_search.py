"""--find: bracket and bisect to the most load within the SLOs, on a model and on a fake server."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from loomserve.cli.bench.command import bench
from loomserve.cli.bench.honesty import ServerPace, probe_flaw
from loomserve.cli.bench.html_report import render
from loomserve.cli.bench.records import RequestRecord
from loomserve.cli.bench.search import (
    NOT_COUNTED,
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
    # The JSON keeps "budget"; the words say what to change.
    assert "raise --duration" in format_answer(result)


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
    failed = [p["value"] for p in search["probes"] if p["passed"] is False]
    assert answer["value"] == max(passed) and answer["fails_at"] == min(failed)
    assert answer["value"] < answer["fails_at"] <= 1.3 * answer["value"] + 1e-9
    # Requests queued behind two slots wait: far past the fake's capacity, TTFT breaks 400 ms.
    assert answer["fails_at"] <= 64
    assert all("summary" in p and "attainment" in p for p in search["probes"])


def test_find_needs_slos() -> None:
    outcome = CliRunner().invoke(bench, ["--find", "max-rate", "--base-url", "http://127.0.0.1:9"])
    assert outcome.exit_code == 2 and "--find needs SLOs" in outcome.output


def released(dispatched: list[float], e2e_s: float) -> list[RequestRecord]:
    """Completed records released at these offsets, each taking e2e_s."""
    return [
        RequestRecord(i, 4, 3, scheduled_s=t, dispatched_s=t, start_s=t, e2e_s=e2e_s)
        for i, t in enumerate(dispatched)
    ]


def pace(offered: float, completed: float | None) -> ServerPace:
    return ServerPace(offered, completed, completed=8, cut_off=0, mean_slot_wait_ms=0.0)


def test_a_probe_that_measured_no_sustained_rate_has_a_flaw() -> None:
    spread = released([i * 0.5 for i in range(8)], e2e_s=1.0)  # 3.5 s of sends, 1 s each
    assert probe_flaw(spread, pace(2.0, 1.95), sent_rate=None) is None
    # 8 requests in 4 ms at "2048 req/s", each taking 1 s: one burst into the slots.
    burst = released([i * 0.0005 for i in range(8)], e2e_s=1.0)
    flaw = probe_flaw(burst, pace(2048.0, 0.0), sent_rate=None)
    assert flaw is not None and "raise --num-prompts" in flaw
    flaw = probe_flaw(spread, pace(2.0, 0.5), sent_rate=None)
    assert flaw is not None and "server fell behind" in flaw and "0.50 req/s" in flaw
    # One late answer of 8 past the window's edge (7/8 of the rate) is no backlog.
    assert probe_flaw(spread, pace(2.0, 1.75), sent_rate=None) is None
    assert probe_flaw(spread, pace(2.0, 1.5), sent_rate=None) is not None
    assert probe_flaw(spread, pace(2.0, 1.95), sent_rate=1.96) is None
    flaw = probe_flaw(spread, pace(2.0, 1.95), sent_rate=1.5)
    assert flaw is not None and "generator fell behind" in flaw
    # A closed loop (max-concurrency) offers no rate: nothing to fall behind.
    assert probe_flaw(burst, pace(math.inf, None), sent_rate=None) is None


def test_a_flawed_probe_fails_whatever_its_attainment() -> None:
    async def probe(value: float, index: int) -> ProbeOutcome:
        flaw = "the server fell behind" if value > 5 else None
        return ProbeOutcome(value=value, met=10, total=10, seconds=0.0, flaw=flaw)

    result, lines = search("max-rate", probe, 1.0)
    assert result.best is not None and result.worst is not None
    assert result.best.value <= 5 < result.worst.value <= 5.5
    assert any("FAIL (the server fell behind)" in line for line in lines)
    assert "fails (the server fell behind)" in format_answer(result)
    assert [p["passed"] for p in search_dict(result)["probes"]] == [
        p.value <= 5 for p in result.probes
    ]


def test_a_cut_off_probe_is_not_counted_in_the_console_json_and_report() -> None:
    async def probe(value: float, index: int) -> ProbeOutcome:
        return ProbeOutcome(value=value, met=1, total=10, seconds=0.0, complete=index == 0)

    result, lines = search("max-rate", probe, 1.0)
    assert lines[-1] == f"probe 2: 0.5 {NOT_COUNTED}"
    assert result.stopped == "budget" and "raise --duration" in format_answer(result)
    search_json = search_dict(result)
    assert [p["passed"] for p in search_json["probes"]] == [False, None]
    page = render({"settings": {"model": "m"}, "search": search_json})
    assert f"<td>{NOT_COUNTED}</td>" in page and "raise --duration" in page
    assert "counted as failed" not in page
    assert "no data" not in page  # the cut-off probe is drawn, apart from the counted one


def find_max_rate(url: str, prompts: int, start: float, slo: str, tmp_path) -> dict:
    out = tmp_path / "search.json"
    args = ["--base-url", url, "--num-prompts", str(prompts), "--input-len", "4"]
    args += ["--output-len", "3", "--find", "max-rate", "--goodput", slo, "--attainment", "90"]
    args += ["--request-rate", str(start), "--find-precision", "0.3", "--duration", "60"]
    args += ["--num-warmups", "0", "--no-progress", "--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    return json.loads(out.read_text())["search"]


def test_bursts_into_free_slots_are_no_rate_the_server_sustains(fake, tmp_path) -> None:
    """Issue 60: 8 prompts into a server that takes them all at once "passed" every rate up to
    thousands of req/s; a probe sent faster than one request's latency is no rate at all."""
    server, url = fake
    server.reset()  # no capacity limit: 8 requests run at once, 140 ms each
    search = find_max_rate(url, 8, 4.0, "ttft:5000", tmp_path)
    assert search["stopped"] != "never failed"
    flaws = [(p["value"], p["flaw"]) for p in search["probes"]]
    assert any("raise --num-prompts" in (f or "") for _, f in flaws), flaws
    answer = search["answer"]
    assert answer is None or answer["value"] < 100  # 7 gaps of at least 140 ms: under 50/s


def test_a_server_that_falls_behind_fails_the_probe(fake, tmp_path) -> None:
    """One request at a time, 140 ms each: at most ~7 req/s, whatever a lenient SLO says."""
    server, url = fake
    server.reset()
    server.capacity = 1
    search = find_max_rate(url, 16, 4.0, "e2el:60000", tmp_path)
    assert search["stopped"] != "never failed"
    answer = search["answer"]
    assert answer is None or answer["value"] <= 8.0
    assert all(p["flaw"] for p in search["probes"] if p["passed"] is False)
