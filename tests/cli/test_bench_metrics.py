"""Pure parts of `loomserve bench`: metrics on hand-made records, schedules, datasets, parsing."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from loomserve.cli.bench.arrivals import arrival_offsets
from loomserve.cli.bench.client import build_payload, chunk_text, error_message
from loomserve.cli.bench.datasets import (
    BenchRequest,
    random_dataset,
    sample_lengths,
    shared_prefix_dataset,
    sharegpt_dataset,
)
from loomserve.cli.bench.metrics import (
    compute_metrics,
    distribution,
    meets_slos,
    output_timeline,
    pacing_stats,
    parse_slos,
    peak_concurrency,
    tpot_s,
)
from loomserve.cli.bench.records import NOT_SENT, TIMEOUT, UNFINISHED, RequestRecord
from loomserve.cli.bench.report import write_json
from loomserve.cli.bench.runner import LoadShape
from loomserve.cli.bench.sweep import parse_sweep, sweep_shapes


def done(
    start: float,
    ttft: float,
    itl: list[float],
    e2e: float,
    tokens: int,
    prompt_tokens: int | None,
    max_tokens: int | None = None,
) -> RequestRecord:
    """A completed request with the given timings (seconds)."""
    return RequestRecord(
        index=0,
        expected_prompt_len=30,
        max_tokens=max_tokens if max_tokens is not None else tokens,
        start_s=start,
        ttft_s=ttft,
        itl_s=itl,
        e2e_s=e2e,
        output_tokens=tokens,
        prompt_tokens=prompt_tokens,
        usage_reported=prompt_tokens is not None,
        chunks=len(itl) + 1,
    )


def failed(kind: str) -> RequestRecord:
    return RequestRecord(index=0, expected_prompt_len=30, max_tokens=4, error_kind=kind)


@pytest.fixture
def records() -> list[RequestRecord]:
    """Three completed requests, and one of each way to fail or not finish."""
    return [
        done(0.0, 0.100, [0.020, 0.020, 0.020], 0.160, 4, prompt_tokens=10),  # TPOT 20 ms
        done(0.5, 0.300, [0.050], 0.350, 2, prompt_tokens=20, max_tokens=4),  # TPOT 50 ms
        done(1.0, 0.200, [], 0.200, 1, prompt_tokens=None),  # one token: no TPOT, no usage
        failed("http_503"),
        failed(TIMEOUT),
        failed(UNFINISHED),
        failed(NOT_SENT),
    ]


def test_counts_tokens_and_throughput(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed, m.unfinished, m.not_sent) == (3, 2, 1, 1)
    assert m.failures == {"http_503": 1, "timeout": 1}
    assert m.total_input == 10 + 20 + 30  # usage where reported, else the dataset's estimate
    assert m.total_output == 7
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(33.5)
    assert m.usage_missing == 1
    assert m.short_outputs == 1
    assert m.request_goodput is None


def test_latency_distributions(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration_s=2.0, percentiles=(90.0, 99.0))
    assert m.ttft.count == 3
    assert m.ttft.mean_ms == pytest.approx(200.0)
    assert m.ttft.median_ms == pytest.approx(200.0)
    assert m.ttft.std_ms == pytest.approx(math.sqrt(20000 / 3))  # population std, as numpy
    assert m.ttft.percentiles_ms == pytest.approx({90.0: 280.0, 99.0: 298.0})  # linear
    # TPOT = (E2E − TTFT) / (tokens − 1), only for answers longer than one token.
    assert m.tpot.count == 2
    assert m.tpot.mean_ms == pytest.approx(35.0)
    assert m.tpot.std_ms == pytest.approx(15.0)
    assert m.tpot.percentiles_ms == pytest.approx({90.0: 47.0, 99.0: 49.7})
    # ITL pools every gap of every request.
    assert m.itl.count == 4
    assert m.itl.mean_ms == pytest.approx(27.5)
    assert m.itl.median_ms == pytest.approx(20.0)
    assert m.itl.std_ms == pytest.approx(math.sqrt(168.75))
    assert m.itl.percentiles_ms == pytest.approx({90.0: 41.0, 99.0: 49.1})
    assert m.e2el.mean_ms == pytest.approx(710.0 / 3)
    assert m.e2el.median_ms == pytest.approx(200.0)
    assert m.e2el.percentiles_ms[90.0] == pytest.approx(320.0)


def test_tpot_matches_definition() -> None:
    record = done(0.0, 0.5, [0.1] * 9, 1.4, 10, prompt_tokens=5)
    assert tpot_s(record) == pytest.approx(0.1)
    # The server bundling tokens into fewer chunks does not change TPOT: usage counts them.
    bundled = done(0.0, 0.5, [0.3, 0.3, 0.3], 1.4, 10, prompt_tokens=5)
    assert tpot_s(bundled) == pytest.approx(0.1)
    assert tpot_s(done(0.0, 0.5, [], 0.5, 1, prompt_tokens=5)) is None


def test_goodput_needs_every_slo(records: list[RequestRecord]) -> None:
    # ttft ≤ 250 and tpot ≤ 30: the first (100/20) and the one-token answer (200/—) pass.
    m = compute_metrics(records, 2.0, slos_ms={"ttft": 250.0, "tpot": 30.0})
    assert m.request_goodput == pytest.approx(1.0)
    m = compute_metrics(records, 2.0, slos_ms={"e2el": 180.0})
    assert m.request_goodput == pytest.approx(0.5)
    m = compute_metrics(records, 2.0, slos_ms={"ttft": 1.0})
    assert m.request_goodput == 0.0


def test_slos_are_inclusive() -> None:
    record = done(0.0, 0.100, [0.020], 0.120, 2, prompt_tokens=1)
    assert meets_slos(record, {"ttft": 100.0, "tpot": 20.0, "e2el": 120.0})
    assert not meets_slos(record, {"ttft": 99.9})


def test_peak_concurrency_and_timeline() -> None:
    overlapping = [
        done(0.0, 0.1, [0.1, 0.1], 0.3, 3, prompt_tokens=1),
        done(0.1, 0.1, [0.1], 0.2, 2, prompt_tokens=1),
        done(0.25, 0.1, [], 0.1, 1, prompt_tokens=1),
        done(0.35, 0.5, [0.2], 0.7, 4, prompt_tokens=1),  # 4 tokens in 2 chunks
    ]
    assert peak_concurrency(overlapping) == 3  # at 0.25-0.30 three requests are in flight
    # Chunks at 0.1 0.2 0.3 | 0.2 0.3 | 0.35 | 0.85 (×2 tokens) 1.05 (×2 tokens)
    assert output_timeline(overlapping) == pytest.approx([8.0, 2.0])
    assert output_timeline(overlapping, bucket_s=0.5) == pytest.approx([12.0, 4.0, 4.0])
    back_to_back = [done(0.0, 0.1, [], 0.1, 1, 1), done(0.1, 0.1, [], 0.1, 1, 1)]
    assert peak_concurrency(back_to_back) == 1


def test_no_samples_is_not_zero() -> None:
    m = compute_metrics([failed("http_500")], duration_s=1.0)
    assert m.completed == 0 and m.failures == {"http_500": 1}
    assert m.ttft.count == 0 and m.ttft.mean_ms is None
    assert distribution([], (99.0,)).percentiles_ms == {}


def test_pacing_stats() -> None:
    records = [RequestRecord(index=i, expected_prompt_len=1, max_tokens=1) for i in range(5)]
    for record, due, sent in zip(
        records, [0.2, 0.4, 0.6, 0.8, 1.0], [0.201, 0.4, 0.64, 0.8, 1.0], strict=True
    ):
        record.scheduled_s, record.dispatched_s = due, sent
    pacing = pacing_stats(records, requested_rate=5.0)
    assert pacing.achieved_rate == pytest.approx(5.0)
    assert pacing.max_lag_ms == pytest.approx(40.0)
    assert pacing.mean_lag_ms == pytest.approx(8.2)
    assert pacing.late == 1
    assert pacing.kept_up
    records[4].dispatched_s = 1.5  # the last one very late: the offered rate fell short
    pacing = pacing_stats(records, requested_rate=5.0)
    assert pacing.achieved_rate == pytest.approx(5 / 1.5)
    assert not pacing.kept_up


def test_arrivals_are_reproducible_and_normalised() -> None:
    assert arrival_offsets(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 2.0, math.inf, seed=0) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    poisson = arrival_offsets(2000, 50.0, 1.0, seed=7)
    assert poisson == arrival_offsets(2000, 50.0, 1.0, seed=7)
    assert poisson != arrival_offsets(2000, 50.0, 1.0, seed=8)
    assert poisson[-1] == pytest.approx(2000 / 50.0)  # the last one is due at N/R exactly
    gaps = np.diff([0.0, *poisson])
    assert gaps.mean() == pytest.approx(1 / 50.0)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)  # exponential: CV 1
    bursty = np.diff([0.0, *arrival_offsets(2000, 50.0, 0.25, seed=7)])
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, abs=0.25)  # gamma: CV 1/√k
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, 1.0, seed=0)


def word_count(texts: list[str]) -> list[int]:
    """A stand-in tokenizer: one token per word."""
    return [len(t.split()) for t in texts]


def two_per_word(texts: list[str]) -> list[int]:
    return [2 * len(t.split()) + 1 for t in texts]


def test_random_prompts_hit_the_target_length() -> None:
    requests = random_dataset(20, 50, 16, 0.0, seed=1, count=word_count)
    assert [r.prompt_len for r in requests] == [50] * 20
    assert [len(r.prompt.split()) for r in requests] == [50] * 20
    assert {r.output_len for r in requests} == {16}
    assert len({r.prompt for r in requests}) == 20
    assert requests == random_dataset(20, 50, 16, 0.0, seed=1, count=word_count)
    # A tokenizer that costs 2 tokens a word (+1) lands within a token of the target.
    for r in random_dataset(10, 41, 16, 0.0, seed=2, count=two_per_word):
        assert abs(r.prompt_len - 41) <= 1 and r.prompt_len == two_per_word([r.prompt])[0]


def test_range_ratio_spreads_lengths() -> None:
    lengths = sample_lengths(random.Random(0), 500, 100, 0.5)
    assert min(lengths) >= 50 and max(lengths) <= 150
    assert len(set(lengths)) > 50
    requests = random_dataset(30, 40, 20, 0.25, seed=3, count=word_count)
    assert all(30 <= r.prompt_len <= 50 and 15 <= r.output_len <= 25 for r in requests)
    with pytest.raises(ValueError):
        sample_lengths(random.Random(0), 1, 10, 1.0)


def test_shared_prefix_groups() -> None:
    requests = shared_prefix_dataset(12, 3, 100, 10, 8, 0.0, seed=0, count=word_count)
    prefixes = {r.system_prompt for r in requests}
    assert len(prefixes) == 3
    assert all(len(p.split()) == 100 for p in prefixes)
    assert all(r.prompt_len == 110 and r.output_len == 8 for r in requests)
    assert sorted(sum(r.system_prompt == p for r in requests) for p in prefixes) == [4, 4, 4]
    assert len({r.prompt for r in requests}) == 12


def test_sharegpt_file(tmp_path) -> None:
    def conversation(human: str, gpt: str) -> dict:
        return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}

    data = [
        conversation("one two three four five", "a b c d e f"),
        conversation("too short", "a b c d e"),  # prompt < 4 tokens
        conversation("w " * 1100, "a b c d"),  # prompt > 1024 tokens
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        conversation("six seven eight nine", "g h i j k l m n"),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    requests = sharegpt_dataset(path, 10, None, seed=0, count=word_count)
    assert sorted((r.prompt_len, r.output_len) for r in requests) == [(4, 8), (5, 6)]
    fixed = sharegpt_dataset(path, 1, 32, seed=0, count=word_count)
    assert len(fixed) == 1 and fixed[0].output_len == 32


def test_payloads() -> None:
    request = BenchRequest("question", 3, 7, system_prompt="be brief")
    completion = build_payload(request, "m", "completions", ignore_eos=True, temperature=0.0)
    assert completion["prompt"] == "be brief\n\nquestion"
    assert completion["max_tokens"] == 7 and completion["ignore_eos"] is True
    assert completion["stream"] and completion["stream_options"] == {"include_usage": True}
    chat = build_payload(
        request, "m", "chat", ignore_eos=False, temperature=0.5, extra_body={"x": 1}
    )
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "question"},
    ]
    assert "ignore_eos" not in chat and chat["x"] == 1 and chat["temperature"] == 0.5


def test_chunk_text_skips_role_announcements() -> None:
    role_only = chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert not role_only[0]
    assert chunk_text({"choices": [{"text": " hi", "finish_reason": None}]}) == (" hi", False)
    assert chunk_text({"choices": [{"delta": {}, "finish_reason": "length"}]})[1]
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == (None, False)
    assert error_message(b'{"error": {"message": "queue full", "code": 503}}') == "queue full"
    assert error_message(b"<html>bad gateway</html>") == "<html>bad gateway</html>"


def test_slo_and_sweep_parsing() -> None:
    assert parse_slos(["ttft:500 tpot:50", "e2el:2000"]) == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 2000.0,
    }
    assert parse_slos(["ttft:1,tpot:2"]) == {"ttft": 1.0, "tpot": 2.0}
    for bad in ("itl:5", "ttft", "ttft:fast", "ttft:-1"):
        with pytest.raises(ValueError):
            parse_slos([bad])
    assert parse_sweep("max-concurrency=1,4,16") == ("max-concurrency", [1.0, 4.0, 16.0])
    assert parse_sweep("request-rate=0.5,inf") == ("request-rate", [0.5, math.inf])
    for bad in ("max-concurrency=1.5", "rate=1", "request-rate=", "request-rate=0"):
        with pytest.raises(ValueError):
            parse_sweep(bad)
    shapes = sweep_shapes(LoadShape(request_rate=3.0), "max-concurrency", [1.0, 4.0])
    assert shapes == [LoadShape(3.0, 1.0, 1), LoadShape(3.0, 1.0, 4)]
    assert isinstance(shapes[0].max_concurrency, int)


def test_result_json_spells_infinity(tmp_path) -> None:
    path = tmp_path / "out" / "result.json"
    write_json(path, {"rate": math.inf, "sweep": ("request-rate", (1.0, math.inf)), "n": 3})
    assert json.loads(path.read_text()) == {
        "rate": "inf",
        "sweep": ["request-rate", [1.0, "inf"]],
        "n": 3,
    }
