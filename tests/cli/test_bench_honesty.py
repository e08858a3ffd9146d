"""The load generator owns up: overload, points printed as they end, unasked cache hits.

Against the fake OpenAI server on loopback (tests/cli/fake_openai.py), a few requests each.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from loomserve.cli.bench.command import bench
from loomserve.cli.bench.honesty import cache_warning, completion_rate, server_pace
from loomserve.cli.bench.records import RequestRecord
from tests.cli.fake_openai import FakeOpenAI, serve_fake


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeOpenAI, str]]:
    with serve_fake() as served:
        yield served


@pytest.fixture
def server(fake: tuple[FakeOpenAI, str]) -> tuple[FakeOpenAI, str]:
    fake[0].reset()
    return fake


def done(start: float, e2e: float) -> RequestRecord:
    record = RequestRecord(index=0, expected_prompt_len=1, max_tokens=1, start_s=start)
    record.ttft_s, record.e2e_s, record.dispatched_s = e2e / 2, e2e, start
    return record


def test_completion_rate_is_measured_over_the_release_window_not_the_tail() -> None:
    # Ten requests a second apart, each taking 5 s: the server keeps up at 1 req/s, although
    # completed/duration (10 / 14 s) would say 0.71.
    records = [done(float(i), 5.0) for i in range(10)]
    assert completion_rate(records) == pytest.approx(1.0)
    assert server_pace(records, 1.0, cut_off=0).kept_up
    # One long last answer (60 s) does not make a server that kept up look behind.
    assert completion_rate([*records[:-1], done(9.0, 60.0)]) == pytest.approx(0.9)
    # Released at 1 req/s and served one at a time every 4 s: behind, at about 0.25.
    slow = [done(float(i), 4.0 * (i + 1) - i) for i in range(10)]
    pace = server_pace(slow, 1.0, cut_off=0)
    assert pace.completion_rate is not None and 0.15 < pace.completion_rate < 0.35
    assert not pace.kept_up
    assert completion_rate(records[:4]) is None  # too few to call a rate
    assert not server_pace(records[:4], 1.0, cut_off=3).kept_up  # cut off: never kept up
    closed = server_pace(records, math.inf, cut_off=0)  # nothing offered to keep up with
    assert closed.kept_up and closed.completion_rate is None


def test_cache_warning_only_for_datasets_that_share_nothing() -> None:
    # A real rerun's figures: 1,040 of 2,064 prompt tokens cached over 8 requests.
    assert cache_warning("random", 2064, 1040, 8, seed=0) is not None
    assert "--seed 3" in (cache_warning("sharegpt", 1000, 500, 4, seed=3) or "")
    # A BOS token or a chat template's opening, shared by chance: 30 of 180 over 30 requests.
    assert cache_warning("random", 180, 30, 30, seed=0) is None
    assert cache_warning("shared-prefix", 2064, 1500, 8, seed=0) is None  # the point of it
    assert cache_warning("random", 2064, None, 8, seed=0) is None  # not reported


def test_an_overloaded_server_is_reported_as_behind_not_as_keeping_up(server, tmp_path) -> None:
    fake, url = server
    fake.capacity = 1  # one request at a time, 160 ms each: about 6 req/s at most
    out = tmp_path / "result.json"
    args = ["--base-url", url, "--num-prompts", "12", "--input-len", "4", "--output-len", "4"]
    args += ["--request-rate", "40", "--num-warmups", "0", "--no-progress"]
    args += ["--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert "Completion rate while sending (req/s):" in outcome.output
    assert "of 40.00 offered (FELL BEHIND)" in outcome.output
    assert "the server fell behind" in outcome.output
    result = json.loads(out.read_text())
    pace = result["server_pace"]
    assert pace["kept_up"] is False and pace["completion_rate"] < 10.0
    assert result["summary"]["completion_rate"] == pytest.approx(pace["completion_rate"])
    assert result["generator"]["kept_up"] is True  # the client sent on time: the server lagged
    assert any("fell behind" in w for w in result["warnings"])


def test_a_server_that_keeps_up_draws_no_overload_warning(server, tmp_path) -> None:
    _, url = server
    # Evenly spaced (burstiness inf), 3 s of releases: a loaded machine's jitter of a few
    # hundred ms stays within the 10 % the verdict allows.
    args = ["--base-url", url, "--num-prompts", "30", "--input-len", "4", "--output-len", "2"]
    args += ["--request-rate", "10", "--burstiness", "inf", "--num-warmups", "0", "--no-progress"]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert "of 10.00 offered" in outcome.output and "FELL BEHIND" not in outcome.output
    assert "fell behind" not in outcome.output


def test_each_sweep_point_is_printed_before_the_next_runs(server) -> None:
    _, url = server
    args = ["--base-url", url, "--num-prompts", "3", "--input-len", "4", "--output-len", "2"]
    args += ["--sweep", "max-concurrency=1,3", "--num-warmups", "0", "--no-progress"]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    text = outcome.output
    first, second = text.index("Sweep point 1 of 2"), text.index("Sweep point 2 of 2")
    summary = text.index("Serving Benchmark Result", first)
    assert first < summary < second  # the first point's summary came before the second ran
    assert text.index("Serving Benchmark Result", second) < text.index("= Sweep =")


def test_unasked_cache_hits_warn_and_the_json_names_the_server_and_label(server, tmp_path):
    fake, url = server
    fake.cached_share = 0.5
    out = tmp_path / "result.json"
    args = ["--base-url", url, "--num-prompts", "4", "--input-len", "80", "--output-len", "2"]
    args += ["--num-warmups", "1", "--no-progress", "--seed", "7", "--label", "rerun A"]
    args += ["--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert "served from its prompt cache" in outcome.output and "--seed 7" in outcome.output
    result = json.loads(out.read_text())
    assert result["label"] == "rerun A"
    assert result["server"]["version"] == "fake-1.0"
    assert result["server"]["model"]["id"] == "fake-model"
    assert result["server"]["server_header"] == "uvicorn"
    # The warm-up's prompt is not the first measured one: the benchmark makes no hit itself.
    prompts = [body["prompt"] for body in fake.bodies]
    assert prompts[0] not in prompts[1:]


def test_the_server_identity_names_the_model_benchmarked_not_the_first_listed(server, tmp_path):
    """Issue 60: "Server → model" named the first of /v1/models, not the one measured."""
    fake, url = server
    fake.model_ids = ["other-model", "fake-model"]
    out = tmp_path / "result.json"
    args = ["--base-url", url, "--model", "fake-model", "--num-prompts", "2", "--input-len", "4"]
    args += ["--output-len", "2", "--num-warmups", "0", "--no-progress", "--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    identity = json.loads(out.read_text())["server"]
    assert identity["model"] == {"id": "fake-model", "owned_by": "owner-fake-model"}
    assert "loomserve_version" not in identity  # not a loomserve: no version claimed for it
