"""The bench's figures against an independent tally of the same run: a timestamping proxy.

The proxy (cli/bench/tap.py) forwards bytes in a process of its own and stamps every read;
h11 parses them afterwards. The parsing is checked on bytes written here, and the whole check
on a real run: loomserve serving the tiny model, the bench's request throughput, output
tokens/s, mean TTFT and mean ITL within 5 % of the proxy's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loomserve.cli.bench.crosscheck import (
    agreements,
    format_agreements,
    generation_exchanges,
    independent_figures,
)
from loomserve.cli.bench.runner import LoadShape
from loomserve.cli.bench.session import BenchConfig, run_session
from loomserve.cli.bench.tap import Capture, Exchange, Read, parse_capture, tapped
from tests.procs import start_gateway, start_worker


def sse(*events: dict | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def request(request_id: str) -> bytes:
    body = b'{"prompt": "hi", "stream": true}'
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-request-id: {request_id}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def text(t: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


def test_the_capture_is_parsed_into_timed_exchanges() -> None:
    # Two requests on one kept-alive connection; events split across reads and chunks, an
    # empty closing event, usage at the end; then a response framed by closing the connection.
    a, b, c = sse(text("a")), sse(text("b")), sse(text("c"))
    rest = sse(text("", "length"), {"choices": [], "usage": {"completion_tokens": 3}}, "[DONE]")
    reads = [
        Read(1.0, True, request("r1")),
        Read(1.5, False, RESPONSE_HEAD + chunk(a + b[:10])),  # "a", and half of "b"
        Read(1.6, False, chunk(b[10:]) + chunk(c[:-1])),  # "c" lacks its blank line yet
        Read(1.7, False, chunk(c[-1:] + rest) + b"0\r\n\r\n"),
        Read(2.0, True, request("r2")[:20]),
        Read(2.1, True, request("r2")[20:]),
        Read(2.4, False, b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + sse(text("z"))),
        Read(2.6, False, sse("[DONE]")),
        Read(2.7, False, b""),
    ]
    one, two = parse_capture(Capture(opened_at=0.5, reads=reads))
    assert (one.request_id, one.method, one.path, one.status) == (
        "r1",
        "POST",
        "/v1/completions",
        200,
    )
    assert one.sent_at == 0.5  # the first request's time starts at the connection's opening
    assert one.text_at == [1.5, 1.6, 1.7]  # each event when its last byte came
    assert one.ended_at == 1.7 and one.done
    assert one.output_tokens == 3 and one.complete
    assert two.request_id == "r2" and two.sent_at == 2.1  # the read that completed its head
    assert two.text_at == [2.4] and two.ended_at == 2.7 and two.output_tokens == 1


def test_the_figures_follow_vllms_definitions() -> None:
    def done(sent: float, texts: list[float], tokens: int) -> Exchange:
        exchange = Exchange("POST", "/v1/completions", None, sent, status=200)
        exchange.text_at, exchange.ended_at, exchange.usage_tokens = texts, texts[-1], tokens
        return exchange

    exchanges = [done(0.0, [0.1, 0.2, 0.3], 3), done(0.5, [0.8, 1.0], 2)]
    figures = independent_figures(exchanges)
    assert figures["request_throughput"] == pytest.approx(2 / 1.0)
    assert figures["output_throughput"] == pytest.approx(5 / 1.0)
    assert figures["mean_ttft_ms"] == pytest.approx(200.0)  # (100 + 300) / 2
    assert figures["mean_itl_ms"] == pytest.approx(400.0 / 3)  # (200 + 200) ms over 3 gaps
    summary = {"request_throughput": 2.09, "output_throughput": 5.0, "mean_ttft_ms": 230.0}
    rows = agreements(summary | {"mean_itl_ms": 133.0}, figures)
    assert [row.agrees for row in rows] == [True, True, False, True]
    assert "NO" in format_agreements(rows)
    probe = Exchange("GET", "/v1/models", None, 0.0)
    assert generation_exchanges([*exchanges, probe]) == exchanges
    assert generation_exchanges(exchanges, request_ids=[]) == []


SLOTS = 16
REQUESTS = 96
ATTEMPTS = 2


def test_the_bench_agrees_with_the_wire_within_5_percent(tiny_model_path: Path) -> None:
    # A queue deeper than the slots, behind requests of 256 tokens: TTFTs of about 400 ms or
    # more, where the client's own stalls (a few to tens of milliseconds, on a loaded 2-core
    # machine, in a process that has imported the whole suite) stay well inside 5 %; and 16
    # slots, so that a tick (an ITL) takes milliseconds even on a fast CPU (with 4 slots and 64
    # tokens, on an Intel Xeon: ITLs of 1-2 ms and TTFTs of 100, which those stalls moved by
    # 5-17 % in 3 runs of 7). Warm-ups at the run's concurrency open the connections the run
    # reuses.
    # Where a run disagrees it is run once more on the same servers: a one-off stall of the
    # client (about 0.3 s before a run's first request, in 2 of 3 CI runs on the Xeon, never
    # when this test ran alone) lengthens that run alone, where a bench that measured wrongly
    # would disagree every time.
    tables: list[str] = []
    with (
        start_worker(tiny_model_path, slots=SLOTS, ctx_size=512) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        for _ in range(ATTEMPTS):
            with tapped(gateway.url) as tap:  # the proxy's capture is read once it stops
                config = BenchConfig(
                    base_url=tap.url,
                    num_prompts=REQUESTS,
                    input_len=64,
                    output_len=256,
                    shape=LoadShape(max_concurrency=2 * SLOTS),
                    num_warmups=2 * SLOTS,
                    duration_s=120.0,
                    progress=False,
                    save_detailed=True,
                    scrape_metrics=False,
                )
                result = run_session(config, echo=lambda *a, **k: None, warn=lambda m: None)
            ids = [r["request_id"] for r in result["requests"]]
            exchanges = generation_exchanges(tap.exchanges(), ids)
            assert len(exchanges) == REQUESTS and all(e.complete for e in exchanges)
            figures = independent_figures(exchanges)
            summary = result["summary"]
            assert summary["completed"] == figures["completed"] == REQUESTS
            assert summary["total_output_tokens"] == sum(e.output_tokens for e in exchanges)
            rows = agreements(summary, figures)
            tables.append(format_agreements(rows))
            print(tables[-1])  # with -s: the table docs/benchmarks.md shows
            if all(row.agrees for row in rows):
                return
    pytest.fail("no run agreed with the wire within 5 %:\n" + "\n\n".join(tables))
