"""`loomserve bench`'s modes against servers that are not loomserve, on the tiny test model.

llama-cpp-python's own OpenAI-compatible server (`python -m llama_cpp.server`, from the
`server` extra) always; llama.cpp's llama-server too when LOOMSERVE_LLAMA_SERVER names its
binary. They differ from loomserve where a load generator must cope: llama-cpp-python's
server streams no usage, ignores ignore_eos (its own knob is min_tokens), has no /tokenize,
no /metrics, streams a token that is part of a character as an empty chunk, and serves one
request at a time; llama-server has slots, usage, /tokenize in its own shape and, with
--metrics, its own metric names.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from loomserve.cli.bench.client import chunk_text, fallback_token_count, is_token_event
from loomserve.cli.bench.command import bench
from loomserve.cli.bench.records import RequestRecord
from tests.procs import free_port, llama_server_binary, start_other_server, stop_other_server

OUTPUT_LEN = 12


@dataclass(frozen=True, slots=True)
class Target:
    """A running server and what the bench should find it does."""

    name: str
    url: str
    reports_usage: bool
    tokenizes: bool
    has_metrics: bool
    extra_args: tuple[str, ...]  # what a user of this server adds to the bench's command


@pytest.fixture(scope="module", params=["llama-cpp-python", "llama-server"])
def target(request: pytest.FixtureRequest, tiny_model_path: Path) -> Iterator[Target]:
    port = free_port()
    if request.param == "llama-cpp-python":
        # One request at a time, queued: its default (interrupt_requests) cancels the running
        # request whenever another arrives, which no load test survives.
        args = [sys.executable, "-m", "llama_cpp.server", "--model", str(tiny_model_path)]
        args += ["--host", "127.0.0.1", "--port", str(port), "--n_ctx", "1024"]
        args += ["--n_threads", "1", "--interrupt_requests", "False"]
        # It ignores ignore_eos; min_tokens keeps the end-of-sequence token away instead.
        found = Target(
            request.param,
            f"http://127.0.0.1:{port}",
            False,
            False,
            False,
            ("--extra-body", '{"min_tokens": 64}'),
        )
    else:
        binary = llama_server_binary()
        args = [binary, "-m", str(tiny_model_path), "--host", "127.0.0.1", "--port", str(port)]
        args += ["-np", "2", "-c", "2048", "-t", "1", "--metrics", "--no-webui"]
        found = Target(request.param, f"http://127.0.0.1:{port}", True, True, True, ())
    proc, log = start_other_server(args, port, request.param)
    try:
        yield found
    finally:
        stop_other_server(proc)
        print(f"{request.param} log: {log}")


def run(target: Target, *args: str) -> Result:
    """`loomserve bench` against the target, a few short requests unless args say otherwise."""
    base = ["--base-url", target.url, "--input-len", "16", "--output-len", str(OUTPUT_LEN)]
    base += ["--num-prompts", "4", "--max-concurrency", "2", "--no-progress", "--timeout", "60"]
    outcome = CliRunner().invoke(bench, [*base, *target.extra_args, *args])
    assert outcome.exit_code == 0, outcome.output
    return outcome


def test_token_events_count_empty_chunks_but_not_announcements() -> None:
    def token(event: dict) -> bool:
        return is_token_event(*chunk_text(event))

    assert token({"choices": [{"text": "", "finish_reason": None}]})  # a byte of a character
    assert not token({"choices": [{"text": "", "finish_reason": "length"}]})  # the closing one
    assert token({"choices": [{"text": "a", "finish_reason": "length"}]})
    assert not token({"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]})
    assert not token({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert token({"choices": [{"delta": {"content": ""}, "finish_reason": None}]})
    assert not token({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    assert not token({"choices": [], "usage": {"completion_tokens": 3}})
    assert chunk_text({"choices": [{"text": "", "finish_reason": None}]}) == ("", False)
    # Without usage: a stream that ended for length made max_tokens tokens, however chunked
    # (llama-cpp-python sends a two-byte character as one chunk or as an empty one and a full
    # one); one that stopped counts its token events.
    record = RequestRecord(index=0, expected_prompt_len=4, max_tokens=12, chunks=11)
    record.finish_reason = "length"
    assert fallback_token_count(record, 12) == 12
    record.finish_reason = "stop"
    assert fallback_token_count(record, 12) == 11


def test_a_plain_run_counts_every_token(target: Target, tmp_path: Path) -> None:
    out = tmp_path / "plain.json"
    outcome = run(target, "--num-prompts", "6", "--result-json", str(out), "--save-detailed")
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0, outcome.output
    # Every token, including those streamed as empty chunks when usage is absent.
    assert summary["total_output_tokens"] == 6 * OUTPUT_LEN
    assert summary["short_outputs"] == 0
    assert summary["usage_missing"] == (0 if target.reports_usage else 6)
    if not target.reports_usage:
        assert "carried no usage" in outcome.output
    assert summary["mean_ttft_ms"] > 0 and summary["mean_itl_ms"] > 0
    assert summary["max_concurrent_requests"] <= 2
    expected = "server /tokenize" if target.tokenizes else "estimated at 4 characters a token"
    assert result["settings"]["token_counts"] == expected
    assert result["server"]["model"]["id"]
    assert all(r["request_id"] and r["output_tokens"] == OUTPUT_LEN for r in result["requests"])
    # Each request's clock starts where it met the wire, after the client took it up.
    assert all(r["dispatched_s"] <= r["taken_up_s"] <= r["start_s"] for r in result["requests"])


def test_find_max_concurrency_stops_by_itself(target: Target, tmp_path: Path) -> None:
    out = tmp_path / "find.json"
    started = time.monotonic()
    outcome = run(
        target,
        *("--find", "max-concurrency", "--goodput", "e2el:3000", "--attainment", "90"),
        *("--num-prompts", "4", "--output-len", "4", "--duration", "30", "--num-warmups", "0"),
        *("--result-json", str(out)),
    )
    assert time.monotonic() - started < 120  # the search's own budget is 30 s
    search = json.loads(out.read_text())["search"]
    probes = search["probes"]
    assert probes and probes[0]["value"] == 2  # it starts from --max-concurrency
    assert all(float(p["value"]).is_integer() and p["total"] == 4 for p in probes)
    assert "probe 1: " in outcome.output and f"probe {len(probes)}: " in outcome.output
    # Two 4-token requests at a time within 3 s: the first probe passes on any machine.
    assert probes[0]["met"] == 4
    assert search["answer"]["value"] >= 1


def test_repeats_and_compare(target: Target, tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    run(target, "--repeats", "2", "--label", "A", "--result-json", str(a))
    outcome = run(target, "--repeats", "2", "--seed", "1", "--label", "B", "--result-json", str(b))
    assert "Mean of 2 runs, 95% CI" in outcome.output
    result = json.loads(b.read_text())
    assert result["repeats"]["n"] == 2 and len(result["runs"]) == 2
    figure = result["repeats"]["figures"]["output_throughput"]
    assert len(figure["values"]) == 2 and figure["ci95"][0] <= figure["mean"] <= figure["ci95"][1]
    compared = CliRunner().invoke(bench, ["compare", str(a), str(b)])
    assert compared.exit_code == 0, compared.output
    assert "B/A" in compared.output and "output_throughput" in compared.output


TRACE = [
    {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]},
    {"timestamp": 200, "input_length": 32, "output_length": 2, "hash_ids": [1, 2]},
    {"timestamp": 500, "input_length": 20, "output_length": 4, "hash_ids": [7, 8]},
    {"timestamp": 800, "input_length": 48, "output_length": 2, "hash_ids": [1, 2, 3]},
]


def test_a_trace_is_replayed_on_its_schedule(target: Target, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(row) for row in TRACE) + "\n")
    out = tmp_path / "trace.json"
    run(
        target,
        *("--dataset", "trace", "--dataset-path", str(trace), "--trace-block-size", "16"),
        *("--time-scale", "0.5", "--num-prompts", "10", "--num-warmups", "0"),
        *("--result-json", str(out), "--save-detailed"),
    )
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 4
    requests = sorted(result["requests"], key=lambda r: r["index"])
    assert [r["scheduled_s"] for r in requests] == pytest.approx([0.0, 0.1, 0.25, 0.4])
    assert all(r["dispatched_s"] >= r["scheduled_s"] for r in requests)  # never early
    assert [r["output_tokens"] for r in requests] == [3, 2, 4, 2]


def test_the_html_report_is_written_and_self_contained(target: Target, tmp_path: Path) -> None:
    report, out = tmp_path / "run.html", tmp_path / "run.json"
    outcome = run(target, "--report", str(report), "--result-json", str(out))
    assert f"Wrote {report}" in outcome.output
    html = report.read_text()
    assert html.lstrip().lower().startswith("<!doctype html")
    assert "<script" not in html and 'src="http' not in html and 'href="http' not in html
    completed = json.loads(out.read_text())["summary"]["completed"]
    assert f'data-key="completed">{completed}<' in html
    assert "<svg" in html  # the distributions and timelines, drawn inline


def test_scrape_metrics_samples_or_says_there_are_none(target: Target, tmp_path: Path) -> None:
    out = tmp_path / "scrape.json"
    # 4 requests 0.5 s apart: the last release comes 2 s after the start, so the run spans
    # whole one-second rate windows however fast the server answers (a run shorter than
    # MIN_RATE_WINDOW_S has no rate at all).
    args = ["--request-rate", "2", "--burstiness", "inf", "--scrape-metrics"]
    outcome = run(target, *args, "--result-json", str(out))
    result = json.loads(out.read_text())
    assert result["summary"]["completed"] == 4
    if not target.has_metrics:
        assert "answered HTTP 404: the server has no metrics" in outcome.output
        assert "the run goes on without server metrics" in outcome.output
        assert "server_metrics" not in result
        return
    scraped = result["server_metrics"]
    assert scraped["server"] == "llama-server" and scraped["errors"] == 0
    assert scraped["sources"]["generation_tokens_per_s"] == "llamacpp:tokens_predicted_total"
    assert scraped["sources"]["running"] == "llamacpp:requests_processing"
    times, rates = scraped["times_s"], scraped["series"]["generation_tokens_per_s"]
    # The counter's increase over the run: the tokens the bench counted.
    generated = sum(
        rate * (times[i] - times[i - 1]) for i, rate in enumerate(rates) if rate is not None
    )
    assert generated == pytest.approx(result["summary"]["total_output_tokens"], abs=0.5)
