"""--repeats and `bench compare`: means with 95 % intervals, and differences told from noise."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from loomserve.cli.bench.command import bench
from loomserve.cli.bench.compare import compare, ratio_interval
from loomserve.cli.bench.html_report import render
from loomserve.cli.bench.repeats import combine, mean_ci, t_quantile
from tests.cli.fake_openai import FakeOpenAI, serve_fake


def test_mean_ci_is_students_t() -> None:
    mean, low, high = mean_ci([10.0, 12.0, 11.0, 13.0, 9.0])
    # sd = 1.581, se = 0.7071, t(4) = 2.776: half-width 1.963
    assert mean == 11.0 and (low, high) == pytest.approx((9.037, 12.963), abs=1e-3)
    assert mean_ci([4.0])[1:] == (float("-inf"), float("inf"))
    assert t_quantile(1) == 12.706 and t_quantile(200) == 1.96


def point(throughput: float, ttft: float) -> dict:
    return {"summary": {"request_throughput": throughput, "mean_ttft_ms": ttft, "completed": 5}}


def test_combine_keeps_every_run_and_means_the_figures() -> None:
    combined = combine([point(1.0, 100.0), point(2.0, 110.0), point(3.0, 120.0)])
    assert combined["summary"]["request_throughput"] == 2.0
    assert combined["summary"]["completed"] == 5  # not a headline figure: the first run's
    figure = combined["repeats"]["figures"]["mean_ttft_ms"]
    assert figure["values"] == [100.0, 110.0, 120.0] and figure["mean"] == 110.0
    assert figure["ci95"][0] < 110.0 < figure["ci95"][1]
    assert combined["repeats"]["n"] == 3 and len(combined["runs"]) == 3


def result_file(tmp_path, name: str, throughputs: list[float], ttfts: list[float]):
    runs = [point(t, f) for t, f in zip(throughputs, ttfts, strict=True)]
    path = tmp_path / name
    path.write_text(json.dumps(combine(runs)))
    return path


def test_compare_tells_a_real_difference_from_noise(tmp_path) -> None:
    a = result_file(tmp_path, "a.json", [10.0, 10.2, 9.8, 10.1], [100, 140, 60, 110])
    b = result_file(tmp_path, "b.json", [12.0, 12.1, 11.9, 12.2], [105, 150, 70, 90])
    rows = {row.figure: row for row in compare(a, b)}
    throughput, ttft = rows["request_throughput"], rows["mean_ttft_ms"]
    assert throughput.ratio == pytest.approx(12.05 / 10.025)
    assert throughput.interval is not None and throughput.interval[0] > 1.0
    assert throughput.verdict == "B better"
    assert ttft.verdict == "within noise"  # 104 against 102.5 ms, runs spread by ±40
    assert ratio_interval([1.0], [2.0, 2.1]) is None


def test_compare_command_prints_ratios_and_refuses_unrelated_files(tmp_path) -> None:
    a = result_file(tmp_path, "a.json", [10.0, 10.2, 9.8], [100, 101, 99])
    b = result_file(tmp_path, "b.json", [8.0, 8.1, 7.9], [150, 151, 149])
    outcome = CliRunner().invoke(bench, ["compare", str(a), str(b)])
    assert outcome.exit_code == 0, outcome.output
    line = next(x for x in outcome.output.splitlines() if x.startswith("mean_ttft_ms"))
    assert "1.500" in line and line.endswith("B worse")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"sweep": {"parameter": "request-rate", "points": []}}))
    outcome = CliRunner().invoke(bench, ["compare", str(a), str(other)])
    assert outcome.exit_code == 1 and "no point in common" in outcome.output


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeOpenAI, str]]:
    with serve_fake() as served:
        yield served


def test_cli_repeats_each_point_with_fresh_prompts(fake, tmp_path) -> None:
    server, url = fake
    server.reset()
    out = tmp_path / "repeats.json"
    args = ["--base-url", url, "--num-prompts", "3", "--input-len", "6", "--output-len", "2"]
    args += ["--max-concurrency", "3", "--repeats", "3", "--num-warmups", "0", "--no-progress"]
    args += ["--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert "Mean of 3 runs, 95% CI" in outcome.output
    result = json.loads(out.read_text())
    figure = result["repeats"]["figures"]["mean_ttft_ms"]
    assert len(figure["values"]) == 3 and figure["ci95"][0] <= figure["mean"] <= figure["ci95"][1]
    assert result["summary"]["mean_ttft_ms"] == pytest.approx(figure["mean"])
    assert [run["seed"] for run in result["runs"]] == [0, 1000, 2000]
    prompts = [body["prompt"] for body in server.bodies]
    assert len(prompts) == 9 and len(set(prompts)) == 9  # no repeat is a cache hit
    compared = CliRunner().invoke(bench, ["compare", str(out), str(out)])
    assert compared.exit_code == 0 and "within noise" in compared.output


def cut_off_point(throughput: float, completed: int, cut: int) -> dict:
    """A run --duration stopped with cut requests unfinished, the server behind."""
    run = point(throughput, 100.0)
    run["summary"] |= {"completed": completed, "unfinished": cut, "not_sent": 0}
    run["server_pace"] = {"cut_off": cut, "kept_up": False}
    run["generator"] = {"kept_up": True}
    return run


def test_compare_refuses_a_verdict_on_runs_cut_off_by_duration(tmp_path) -> None:
    """Issue 60: 4 of 8 completed in each of 3 repeats, and compare printed a tight CI."""
    a = tmp_path / "a.json"
    a.write_text(json.dumps(combine([cut_off_point(t, 4, 4) for t in (5.0, 5.1, 4.9)])))
    b = result_file(tmp_path, "b.json", [10.0, 10.2, 9.8], [100, 101, 99])
    rows = compare(a, b)
    assert rows and all(row.verdict == "no verdict: incomplete runs" for row in rows)
    cut = "A: 3 of 3 runs cut off by --duration (completed 4 of 8, 4 of 8, 4 of 8)"
    assert cut in rows[0].caveats and "A: the server fell behind in 3 of 3 runs" in rows[0].caveats
    outcome = CliRunner().invoke(bench, ["compare", str(b), str(a)])
    assert outcome.exit_code == 0, outcome.output
    assert "warning: B: 3 of 3 runs cut off by --duration" in outcome.output
    assert "B better" not in outcome.output and "B worse" not in outcome.output


def test_compare_names_who_fell_behind_beside_its_verdict(tmp_path) -> None:
    runs = [point(t, 100.0) | {"server_pace": {"kept_up": t < 10}} for t in (9.0, 9.1, 10.0)]
    runs = [run | {"generator": {"kept_up": False}} for run in runs]
    a = tmp_path / "a.json"
    a.write_text(json.dumps(combine(runs)))
    b = result_file(tmp_path, "b.json", [12.0, 12.1, 11.9], [100, 101, 99])
    rows = {row.figure: row for row in compare(a, b)}
    assert rows["request_throughput"].verdict == "B better"  # complete runs: a verdict
    assert rows["request_throughput"].caveats == (
        "A: the server fell behind in 1 of 3 runs",
        "A: the load generator fell behind in 3 of 3 runs",
    )


def test_a_real_cut_off_run_reaches_the_comparison(fake, tmp_path) -> None:
    """One slot, 140 ms a request, 0.3 s of --duration: 6 requests cannot all finish."""
    server, url = fake
    server.reset()
    server.capacity = 1
    out = tmp_path / "cut.json"
    args = ["--base-url", url, "--num-prompts", "6", "--input-len", "4", "--output-len", "3"]
    args += ["--duration", "0.3", "--repeats", "2", "--num-warmups", "0", "--no-progress"]
    args += ["--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    compared = CliRunner().invoke(bench, ["compare", str(out), str(out)])
    assert compared.exit_code == 0, compared.output
    assert "warning: A: 2 of 2 runs cut off by --duration" in compared.output
    assert "no verdict: incomplete runs" in compared.output
    assert "within noise" not in compared.output


def test_searches_compare_by_their_answers_and_repeats_show_intervals_in_the_report(tmp_path):
    for name, value in (("a.json", 4.0), ("b.json", 6.0)):
        search = {"mode": "max-rate", "answer": {"value": value}, "probes": []}
        (tmp_path / name).write_text(json.dumps({"search": search}))
    (row,) = compare(tmp_path / "a.json", tmp_path / "b.json")
    assert (row.point, row.figure, row.ratio) == ("search answer", "max-rate", 1.5)
    assert row.verdict == "no interval (use --repeats)"
    combined = combine([point(1.0, 100.0), point(2.0, 110.0), point(3.0, 120.0)])
    page = render({"settings": {}} | combined)
    low, high = combined["repeats"]["figures"]["mean_ttft_ms"]["ci95"]
    assert f'<td data-key="mean_ttft_ms">110.00</td><td>95% CI [{low:.2f}, {high:.2f}]</td>' in page
