"""`loomserve bench` against a fake OpenAI server with known timings, on loopback.

The fake streams its first chunk 100 ms after the request and one every 20 ms after that, on
an absolute schedule, then usage and [DONE]; a plan keyed by request index makes chosen
requests fail in chosen ways. Every load loop here is a few requests and a second or two.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from loomserve.cli.bench.classes import RequestClass, assign_classes, parse_class
from loomserve.cli.bench.client import StreamingClient
from loomserve.cli.bench.command import bench
from loomserve.cli.bench.datasets import BenchRequest
from loomserve.cli.bench.metrics import compute_metrics, pacing_stats
from loomserve.cli.bench.probe import ServerTokenizer
from loomserve.cli.bench.records import RequestRecord
from loomserve.cli.bench.runner import LoadShape, RunResult, run_load
from loomserve.cli.bench.selftest import run_self_test
from tests.cli.fake_openai import FIRST_S, GAP_S, FakeOpenAI, serve_fake

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeOpenAI, str]]:
    """The fake server on a free 127.0.0.1 port, in a thread, for this module."""
    with serve_fake() as served:
        yield served


@pytest.fixture
def server(fake: tuple[FakeOpenAI, str]) -> tuple[FakeOpenAI, str]:
    fake[0].reset()
    return fake


def run(
    url: str,
    n: int,
    output_len: int,
    shape: LoadShape,
    endpoint: str = "completions",
    timeout_s: float = 10.0,
    duration_s: float = 20.0,
) -> RunResult:
    """Run the real benchmark loop against url."""

    async def go() -> RunResult:
        client = StreamingClient(url, "fake-model", endpoint, timeout_s=timeout_s)
        try:
            prompts = [BenchRequest(f"prompt number {i}", 3, output_len) for i in range(n)]
            return await run_load(client, prompts, shape, seed=0, duration_s=duration_s)
        finally:
            await client.aclose()

    return asyncio.run(go())


def at_least(measured: float | None, nominal: float) -> bool:
    """A timing the fake server's sleeps set: no less than nominal (less a clock's rounding).

    There is no upper bound in milliseconds: a loaded machine delays every figure by any
    amount (a 100 ms TTFT read 267 ms at load 15). What catches a wrong unit or a wrong count
    instead is that the figures fit together and fit the run's own clock, which no delay
    changes."""
    return measured is not None and measured >= 0.9 * nominal


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_metrics_match_the_servers_timetable(server, endpoint: str) -> None:
    fake, url = server
    started = time.perf_counter()
    result = run(url, n=6, output_len=6, shape=LoadShape(max_concurrency=3), endpoint=endpoint)
    wall_s = time.perf_counter() - started
    m = compute_metrics(result.records, result.duration_s)
    assert (m.completed, m.failed) == (6, 0)
    assert m.total_output == 36 and m.usage_missing == 0 and m.short_outputs == 0
    assert m.total_input == 6 * 3  # from usage.prompt_tokens
    assert fake.max_in_flight == 3  # two waves of three
    # Each figure is at least the timetable's: the server sleeps it.
    assert at_least(m.ttft.mean_ms, 100.0)
    assert at_least(m.ttft.percentiles_ms[99.0], 100.0)
    assert m.itl.count == 6 * 5
    assert at_least(m.itl.mean_ms, 20.0) and at_least(m.itl.median_ms, 20.0)
    assert at_least(m.tpot.mean_ms, 20.0)
    assert at_least(m.e2el.mean_ms, 200.0)
    assert at_least(result.duration_s, 2 * 0.2)  # two waves of 200 ms, one after the other
    # And the figures fit together and fit the run, however late each came.
    assert m.ttft.mean_ms is not None and m.tpot.mean_ms is not None
    assert m.e2el.mean_ms == pytest.approx(m.ttft.mean_ms + 5 * m.tpot.mean_ms)
    assert m.itl.mean_ms <= m.tpot.mean_ms + 1e-6  # the gaps lie within each request
    assert m.ttft.percentiles_ms[99.0] < m.e2el.percentiles_ms[99.0]
    assert m.e2el.percentiles_ms[99.0] <= 1000 * result.duration_s <= 1000 * wall_s
    assert m.request_throughput == pytest.approx(6 / result.duration_s)
    assert m.output_throughput == pytest.approx(36 / result.duration_s)
    assert fake.bodies[0]["stream_options"] == {"include_usage": True}
    assert fake.bodies[0]["ignore_eos"] is True


def test_failures_are_sorted_by_kind(server) -> None:
    fake, url = server
    fake.plan = {0: "503", 1: "broken", 2: "truncated", 3: "slow", 4: "no_usage"}
    result = run(url, n=7, output_len=4, shape=LoadShape(), timeout_s=1.0)
    m = compute_metrics(result.records, result.duration_s)
    assert m.failures == {"broken_stream": 2, "http_503": 1, "timeout": 1}
    assert m.completed == 3 and m.failed == 4
    assert result.records[0].error == "queue full"
    assert result.records[3].error_kind == "timeout"
    assert result.duration_s < 2.0  # the slow one was abandoned at its timeout
    # Without usage, the output tokens are the text chunks, and the summary says so.
    assert result.records[4].output_tokens == 4 and not result.records[4].usage_reported
    assert m.usage_missing == 1


def test_tokens_without_text_are_counted_and_timed(server) -> None:
    # llama-cpp-python's server: every other token an empty chunk, and no usage; llama-server:
    # an answer of only a character's unfinished bytes, all in the closing event.
    fake, url = server
    fake.plan = {0: "byte_chunks", 1: "held_back"}
    result = run(url, n=2, output_len=4, shape=LoadShape(max_concurrency=1))
    chunked, held = result.records
    assert chunked.success and not chunked.usage_reported
    assert chunked.output_tokens == 4 and chunked.chunks == 4  # the closing "" is no token
    assert len(chunked.itl_s) == 3 and chunked.finish_reason == "length"
    assert held.success and held.output_tokens == 4 and held.chunks == 0
    assert held.ttft_s is not None and held.e2e_s is not None
    assert held.ttft_s >= 0.1 + 3 * 0.02 - 0.005  # at the closing event, not before
    assert held.itl_s == []
    m = compute_metrics(result.records, result.duration_s)
    assert m.short_outputs == 0 and m.total_output == 8


def test_poisson_pacing_offers_the_requested_rate(server) -> None:
    _, url = server
    result = run(url, n=20, output_len=1, shape=LoadShape(request_rate=20.0))
    pacing = pacing_stats(result.records, 20.0)
    last_due = max(r.scheduled_s for r in result.records)
    assert last_due == pytest.approx(1.0)  # N/R
    assert pacing.achieved_rate == pytest.approx(20.0, rel=0.1)
    assert pacing.max_lag_ms < 50.0
    assert result.duration_s == pytest.approx(1.0 + FIRST_S, abs=0.15)
    starts = sorted(r.start_s for r in result.records)
    assert len(set(starts)) == 20  # spread out, not sent together


def test_max_concurrency_is_respected(server) -> None:
    fake, url = server
    generated = fake.generated  # a count over the module's tests: reset() keeps it
    result = run(url, n=8, output_len=3, shape=LoadShape(max_concurrency=2))
    m = compute_metrics(result.records, result.duration_s)
    assert m.completed == 8 and fake.generated - generated == 8 * 3
    # Bounds from the work, not the clock: the server's own count of requests in flight
    # never passed 2 and reached it (the slots were used), as the client saw too.
    assert fake.max_in_flight == 2
    assert m.peak_concurrency == 2
    # Two at a time, 8 requests are at least four waves of the fake's timetable; a busy
    # machine only lengthens its sleeps, so this holds under any load.
    assert result.duration_s >= 4 * (FIRST_S + 2 * GAP_S)


def test_duration_bounds_the_run(server) -> None:
    fake, url = server
    fake.plan = dict.fromkeys(range(10), "slow")
    started = time.perf_counter()
    result = run(url, n=10, output_len=2, shape=LoadShape(request_rate=4.0), duration_s=0.8)
    assert time.perf_counter() - started < 2.0
    m = compute_metrics(result.records, result.duration_s)
    assert result.duration_s == pytest.approx(0.8, abs=0.05)
    assert m.completed == 0 and m.failed == 0
    # Those due after 0.8 s were never sent; those sent were cut off when the time ran out.
    due_late = sum(r.scheduled_s >= 0.8 for r in result.records)
    assert 0 < due_late < 10
    assert (m.not_sent, m.unfinished) == (due_late, 10 - due_late)


def test_cli_writes_result_json_and_plot(server, tmp_path) -> None:
    fake, url = server
    out, plot = tmp_path / "result.json", tmp_path / "plot.png"
    args = ["--base-url", url, "--num-prompts", "5", "--input-len", "12", "--output-len", "3"]
    args += ["--max-concurrency", "5", "--goodput", "ttft:1000 tpot:1000", "--no-progress"]
    args += ["--result-json", str(out), "--save-detailed", "--plot", str(plot), "--seed", "3"]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert "Serving Benchmark Result" in outcome.output
    assert "Mean TTFT (ms):" in outcome.output and "P99 ITL (ms):" in outcome.output
    result = json.loads(out.read_text())
    assert result["settings"]["model"] == "fake-model"  # from /v1/models
    assert result["settings"]["token_counts"] == "server /tokenize"
    summary = result["summary"]
    assert summary["completed"] == 5 and summary["failed"] == 0
    assert summary["total_input_tokens"] == 5 * 12  # sized exactly with /tokenize
    assert summary["total_cached_tokens"] == 5
    assert summary["request_goodput"] == pytest.approx(summary["request_throughput"])
    for key in ("mean_ttft_ms", "median_tpot_ms", "p90_itl_ms", "p99_e2el_ms", "std_ttft_ms"):
        assert summary[key] > 0
    assert len(result["requests"]) == 5
    assert len(result["requests"][0]["itl_s"]) == 2
    assert uuid.UUID(result["requests"][0]["request_id"])  # some servers insist on UUIDs
    assert result["generator"]["kept_up"] is True
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert len(fake.bodies) == 6  # one warm-up, five measured


def test_cli_shared_prefix_and_sharegpt(server, tmp_path) -> None:
    fake, url = server
    out = tmp_path / "prefix.json"
    args = ["--base-url", url, "--dataset", "shared-prefix", "--num-prompts", "6"]
    args += ["--num-groups", "2", "--prefix-len", "40", "--input-len", "8", "--output-len", "2"]
    args += ["--num-warmups", "0", "--no-progress", "--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert json.loads(out.read_text())["summary"]["total_input_tokens"] == 6 * (40 + 8)
    prompts = [body["prompt"] for body in fake.bodies]
    assert len({p.split("\n\n")[0] for p in prompts}) == 2  # two shared system prompts

    fake.reset()
    turns = [
        {"conversations": [{"value": f"tell me a story number {i} please"}, {"value": "ok " * i}]}
        for i in range(4, 10)
    ]
    (tmp_path / "sharegpt.json").write_text(json.dumps(turns))
    args = ["--base-url", url, "--dataset-path", str(tmp_path / "sharegpt.json")]
    args += ["--num-prompts", "3", "--num-warmups", "0", "--no-progress", "--endpoint", "chat"]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert sorted(body["max_tokens"] for body in fake.bodies) != [128] * 3  # answers' lengths
    assert all(4 <= body["max_tokens"] <= 9 for body in fake.bodies)
    assert len(fake.bodies) == 3


def test_cli_sweep(server, tmp_path) -> None:
    fake, url = server
    fake.reset()
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    args = ["--base-url", url, "--model", "fake-model", "--num-prompts", "4", "--input-len", "5"]
    args += ["--output-len", "2", "--sweep", "max-concurrency=1,4", "--no-progress"]
    args += ["--endpoint", "chat", "--result-json", str(out), "--plot", str(plot)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert "Sweep" in outcome.output
    sweep = json.loads(out.read_text())["sweep"]
    assert sweep["parameter"] == "max-concurrency"
    assert [p["value"] for p in sweep["points"]] == [1.0, 4.0]
    one, four = (p["summary"] for p in sweep["points"])
    assert one["completed"] == four["completed"] == 4
    # That the second point ran four at once is read from the requests' own times, not from
    # its throughput: on a busy machine four short requests at once can take as long as one
    # after another (it failed that way beside the rest of the suite).
    assert one["max_concurrent_requests"] == 1 and four["max_concurrent_requests"] == 4
    assert plot.read_bytes().startswith(PNG_MAGIC)
    # Each point draws its own prompts, so a prompt cache cannot favour the later one.
    prompts = [json.dumps(body["messages"]) for body in fake.bodies[1:]]  # after the warm-up
    assert len(prompts) == 8 and not set(prompts[:4]) & set(prompts[4:])


def test_cli_rejects_bad_options(server) -> None:
    _, url = server
    for bad in (["--goodput", "itl:5"], ["--sweep", "threads=1,2"], ["--percentiles", "150"]):
        outcome = CliRunner().invoke(bench, ["--base-url", url, *bad])
        assert outcome.exit_code == 2, outcome.output
    unreachable = CliRunner().invoke(bench, ["--base-url", "http://127.0.0.1:9", "--no-progress"])
    assert unreachable.exit_code == 1 and "cannot reach" in unreachable.output


def test_self_test_measures_the_generator() -> None:
    lines: list[str] = []
    result = run_self_test(echo=lines.append, scale=0.05)
    assert result["failed"] == 0
    assert result["max_request_rate"] > 20 and result["max_chunk_rate"] > 500
    # A chunk's CPU is what the chunk run took beyond its requests' share; at this scale (3
    # streams) the per-request estimate's noise can exceed it, and the estimate is then 0.
    assert 0 <= result["cpu_us_per_chunk"] < result["cpu_us_per_request"]
    assert math.isfinite(result["paced_achieved_rate"]) and result["paced_achieved_rate"] > 0
    assert "Load generator self-test" in lines[-1]


@pytest.mark.parametrize("llama_server", [False, True])
def test_server_tokenizer_speaks_vllm_and_llama_server(server, llama_server: bool) -> None:
    fake, url = server
    fake.llama_server_tokenize = llama_server
    tokenizer = ServerTokenizer(url, "fake-model", None)
    try:
        assert tokenizer.available()
        assert tokenizer.body_key == ("content" if llama_server else "prompt")
        assert tokenizer.count(["one two three", "four"]) == [3, 1]
    finally:
        tokenizer.close()
        fake.reset()


def test_a_kept_alive_connection_the_server_dropped_is_dialled_again() -> None:
    """Like llama-server's idle timeout racing a new request: the server reads the second
    request on a kept-alive connection and closes it unanswered; the client dials again."""
    event = json.dumps(
        {
            "choices": [{"index": 0, "text": " hi", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    )
    body = f"data: {event}\n\ndata: [DONE]\n\n".encode()
    answer = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    answer += b"content-length: %d\r\n\r\n%s" % (len(body), body)
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for answered in (True, False):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE)[1])
            await reader.readexactly(length)
            if answered:
                writer.write(answer)
                await writer.drain()
        writer.close()

    async def main() -> list[RequestRecord]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = StreamingClient(url, "fake-model", "completions", timeout_s=10)
        records = [RequestRecord(index=i, expected_prompt_len=3, max_tokens=1) for i in range(3)]
        try:
            for record in records:
                now = time.perf_counter()
                await client.send(BenchRequest("a prompt", 3, 1), record, now, now + 10)
        finally:
            await client.aclose()
            server.close()
        return records

    records = asyncio.run(main())
    assert [(r.error_kind, r.output_tokens) for r in records] == [(None, 1)] * 3
    assert connections == 3  # the first, then one more after each dropped request


def test_cli_sends_request_classes_and_reports_each(server, tmp_path) -> None:
    fake, url = server
    out = tmp_path / "result.json"
    args = ["--base-url", url, "--num-prompts", "12", "--input-len", "8", "--output-len", "3"]
    args += ["--max-concurrency", "12", "--no-progress", "--num-warmups", "0", "--seed", "1"]
    args += ["--class", "chat:priority=0,user=alice,share=1"]
    args += ["--class", "batch:priority=5,user=bob,share=2", "--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    assert "Per class (ms)" in outcome.output
    sent = {(body.get("priority"), body.get("user")) for body in fake.bodies}
    assert sent == {(0, "alice"), (5, "bob")}
    classes = json.loads(out.read_text())["classes"]
    assert set(classes) == {"chat", "batch"}
    assert classes["chat"]["completed"] + classes["batch"]["completed"] == 12
    assert classes["chat"]["median_ttft_ms"] >= FIRST_S * 1000


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("a", RequestClass("a")),
        ("hi:priority=-2,user=u1,share=0.5", RequestClass("hi", -2, "u1", 0.5)),
    ],
)
def test_request_classes_parse(spec, expected) -> None:
    assert parse_class(spec) == expected


@pytest.mark.parametrize("spec", [":priority=1", "a:priority=x", "a:share=0", "a:colour=red"])
def test_bad_request_classes_are_refused(spec) -> None:
    with pytest.raises(ValueError):
        parse_class(spec)


def test_classes_are_drawn_by_share_and_seed() -> None:
    requests = [BenchRequest(f"p{i}", 1, 1) for i in range(400)]
    classes = [RequestClass("few", 0, share=1), RequestClass("many", 1, share=3)]
    drawn = assign_classes(requests, classes, seed=4)
    assert drawn == assign_classes(requests, classes, seed=4)
    many = sum(r.label == "many" for r in drawn)
    assert 260 < many < 340 and all(r.priority == (r.label == "many") for r in drawn)
