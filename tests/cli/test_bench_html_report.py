"""--report FILE.html, checked in a real browser: Debian's Chromium, driven by Playwright.

The page must render with no console error, fetch nothing but itself, and show the figures
the result JSON holds. Without Chromium (`apt-get install chromium`; .ci/run installs it) or
Playwright the browser tests skip and say which is missing.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from click.testing import CliRunner

from loomserve.cli.bench.command import bench
from loomserve.cli.bench.html_report import fmt, render
from loomserve.cli.bench.search import ProbeOutcome, SearchResult, search_dict
from tests.cli.fake_openai import FakeOpenAI, serve_fake


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeOpenAI, str]]:
    with serve_fake() as served:
        yield served


def invoke(args: list[str]):
    """Run the CLI in a thread of its own: Playwright's sync API holds this thread's loop."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(CliRunner().invoke, bench, args).result()


def open_page(browser, path: Path):
    """The report loaded in a new page, with its console errors and requests collected."""
    page = browser.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    return page, errors, requests


def test_a_runs_report_renders_and_shows_the_jsons_figures(browser, fake, tmp_path) -> None:
    server, url = fake
    server.reset()
    server.metrics = True
    out, html = tmp_path / "result.json", tmp_path / "report.html"
    args = ["--base-url", url, "--num-prompts", "8", "--input-len", "6", "--output-len", "30"]
    args += ["--max-concurrency", "4", "--num-warmups", "0", "--no-progress", "--label", "A<b>"]
    args += ["--class", "chat:share=1", "--class", "batch:share=1", "--goodput", "ttft:500"]
    args += ["--result-json", str(out), "--report", str(html)]
    outcome = invoke(args)
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(out.read_text())
    page, errors, requests = open_page(browser, html)
    try:
        assert errors == []
        assert requests == [html.as_uri()]  # self-contained: nothing else fetched
        assert page.title() == "loomserve bench: A<b>"  # the label, escaped, not markup
        for key in ("completed", "request_throughput", "mean_ttft_ms", "p99_itl_ms"):
            cell = page.locator(f'section td[data-key="{key}"]').first
            assert cell.inner_text() == fmt(result["summary"][key]), key
        charts = page.locator("svg.chart")
        # Four distributions, two timelines, and the server's five series (vLLM's names).
        assert charts.count() == 4 + 2 + len(result["server_metrics"]["series"])
        box = charts.first.bounding_box()
        assert box is not None and box["width"] > 300 and box["height"] > 200
        assert page.locator("svg.chart rect[fill]").count() > 10  # bars drawn
        assert page.locator("svg.chart polyline").count() >= 2  # lines drawn
        assert page.get_by_text("Per class").is_visible()
        assert page.get_by_text("Sampled from a vllm server's /metrics.").is_visible()
    finally:
        page.close()


def test_a_sweeps_report_has_its_table_and_curves(browser, fake, tmp_path) -> None:
    server, url = fake
    server.reset()
    out, html = tmp_path / "sweep.json", tmp_path / "sweep.html"
    args = ["--base-url", url, "--num-prompts", "4", "--input-len", "6", "--output-len", "3"]
    args += ["--sweep", "max-concurrency=1,4", "--num-warmups", "0", "--no-progress"]
    args += ["--result-json", str(out), "--report", str(html)]
    outcome = invoke(args)
    assert outcome.exit_code == 0, outcome.output
    points = json.loads(out.read_text())["sweep"]["points"]
    page, errors, _ = open_page(browser, html)
    try:
        assert errors == []
        rows = page.locator("table.sweep tr")
        assert rows.count() == 3  # a header and two points
        second = rows.nth(2).locator("td")
        assert second.nth(0).inner_text() == "4"
        assert second.nth(3).inner_text() == fmt(points[1]["summary"]["request_throughput"])
        assert page.locator("section").count() == 2  # each point's details
    finally:
        page.close()


def test_a_searchs_report_states_the_answer() -> None:
    result = SearchResult("max-concurrency", 0.9, 0.1)
    result.best = ProbeOutcome(6.0, 19, 20, 2.0, {"summary": {"completed": 20}})
    result.worst = ProbeOutcome(7.0, 12, 20, 2.0, {"summary": {"completed": 20}})
    result.probes = [result.best, result.worst]
    page = render({"settings": {"model": "m"}, "search": search_dict(result)})
    assert '<b data-key="answer">6.00</b> concurrent requests' in page
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")


def test_a_rate_searchs_attainment_is_drawn_on_a_log_axis() -> None:
    """Issue 60: a search that doubles and bisects on a log scale was drawn on a linear axis."""
    result = SearchResult("max-rate", 0.9, 0.1)
    point = {"summary": {"completed": 20}}
    values = ((1.0, 20), (2.0, 20), (4.0, 19), (8.0, 5))
    result.probes = [ProbeOutcome(v, m, 20, 1.0, point) for v, m in values]
    result.best, result.worst = result.probes[2], result.probes[3]
    page = render({"settings": {"model": "m"}, "search": search_dict(result)})
    chart = page[page.index('aria-label="Attainment against load"') :]
    chart = chart[: chart.index("</svg>")]
    xs = [float(x) for x in re.findall(r'<circle cx="([0-9.]+)"', chart)]
    assert len(xs) == 4  # every probe drawn
    gaps = [b - a for a, b in itertools.pairwise(xs)]
    assert max(gaps) - min(gaps) < 0.5  # each doubling the same width
    assert "req/s (log scale)" in page


def test_a_search_whose_only_probe_was_cut_off_still_draws_it() -> None:
    result = SearchResult("max-rate", 0.9, 0.1, stopped="budget")
    result.probes = [ProbeOutcome(3.0, 4, 10, 1.0, complete=False)]
    page = render({"settings": {"model": "m"}, "search": search_dict(result)})
    assert "no data" not in page and page.count("<circle") == 1
    assert "cut off by --duration; not counted" in page and "raise --duration" in page
