"""--dataset trace (a Mooncake-style trace, on its own clock) and --dataset jsonl (prompts)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from loomserve.cli.bench.command import bench
from loomserve.cli.bench.datasets import approximate_token_counts
from loomserve.cli.bench.trace import prompts_dataset, trace_dataset
from tests.cli.fake_openai import FakeOpenAI, serve_fake

# Mooncake's published trace lines look like this, with 512-token blocks; ours are 16.
TRACE = [
    {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]},
    {"timestamp": 200, "input_length": 32, "output_length": 2, "hash_ids": [1, 2]},
    {"timestamp": 500, "input_length": 20, "output_length": 4, "hash_ids": [7, 8]},
    {"timestamp": 800, "input_length": 48, "output_length": 2, "hash_ids": [1, 2, 3]},
]


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_trace_requests_share_blocks_where_the_trace_shares_hash_ids(tmp_path) -> None:
    path = write_lines(tmp_path / "trace.jsonl", TRACE)
    requests = trace_dataset(path, 10, 16, 0.5, seed=0, count=approximate_token_counts)
    assert [r.due_s for r in requests] == [0.0, 0.1, 0.25, 0.4]  # ms x 0.5
    assert [r.output_len for r in requests] == [3, 2, 4, 2]
    assert [r.prompt_len for r in requests] == [40, 32, 20, 48]
    first, second, third, fourth = (r.prompt for r in requests)
    assert first.startswith(second + " ")  # blocks 1 and 2 shared, in place
    assert not third.startswith(first[:20])  # no hash id in common
    assert fourth.startswith(first) and len(fourth) > len(first)  # block 3 whole, not cut
    assert trace_dataset(path, 2, 16, 1.0, 0, approximate_token_counts)[1].due_s == 0.2


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"timestamp": 0, "input_length": 0, "output_length": 1}, "input_length"),
        ({"timestamp": -1, "input_length": 4, "output_length": 1}, "timestamp"),
        ({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": "x"}, "hash_ids"),
    ],
)
def test_bad_trace_lines_are_named(tmp_path, row, message) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match=message):
        trace_dataset(path, 10, 16, 1.0, 0, approximate_token_counts)


def test_jsonl_prompts_and_chats(tmp_path) -> None:
    rows = [
        {"prompt": "tell me about rivers", "max_tokens": 5},
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "what is a lake?"},
            ]
        },
    ]
    requests = prompts_dataset(
        write_lines(tmp_path / "p.jsonl", rows), 10, 7, approximate_token_counts
    )
    assert requests[0].prompt == "tell me about rivers" and requests[0].output_len == 5
    chat = requests[1]
    assert chat.system_prompt == "be brief" and chat.prompt == "what is a lake?"
    assert chat.history == (("user", "hi"), ("assistant", "hello")) and chat.output_len == 7
    bad = write_lines(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": 3}]}])
    with pytest.raises(ValueError, match="line 1"):
        prompts_dataset(bad, 10, 7, approximate_token_counts)


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeOpenAI, str]]:
    with serve_fake() as served:
        yield served


def test_cli_replays_the_trace_on_its_schedule(fake, tmp_path) -> None:
    server, url = fake
    server.reset()
    trace = write_lines(tmp_path / "trace.jsonl", TRACE)
    out = tmp_path / "result.json"
    args = ["--base-url", url, "--dataset", "trace", "--dataset-path", str(trace)]
    args += ["--time-scale", "2", "--trace-block-size", "16", "--num-warmups", "0"]
    args += ["--no-progress", "--save-detailed", "--result-json", str(out)]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(out.read_text())
    requests = result["requests"]
    assert [r["scheduled_s"] for r in requests] == [0.0, 0.4, 1.0, 1.6]
    # Sent on the trace's clock: never early, so the last no sooner than 1.6 s in (a loaded
    # machine may make any of them late, which the summary reports as send lag).
    assert all(r["scheduled_s"] <= r["dispatched_s"] for r in requests)
    assert requests[-1]["dispatched_s"] >= 1.6
    assert [body["max_tokens"] for body in server.bodies] == [3, 2, 4, 2]
    assert result["summary"]["completed"] == 4
    assert result["shape"]["request_rate"] == pytest.approx(4 / 1.6)  # the trace's own rate


def test_cli_sends_jsonl_chats(fake, tmp_path) -> None:
    server, url = fake
    server.reset()
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)]
    path = write_lines(tmp_path / "chats.jsonl", rows)
    args = ["--base-url", url, "--dataset", "jsonl", "--dataset-path", str(path)]
    args += ["--endpoint", "chat", "--output-len", "2", "--num-warmups", "0", "--no-progress"]
    outcome = CliRunner().invoke(bench, args)
    assert outcome.exit_code == 0, outcome.output
    sent = sorted(body["messages"][-1]["content"] for body in server.bodies)
    assert sent == ["question 0", "question 1", "question 2"]
