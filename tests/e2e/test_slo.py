"""End to end: two API keys and two priorities through a gateway to a worker scheduling by
priority; the urgent request preempts, the preempted stream only pauses."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import Proc, free_port, scrape_metrics, start_gateway, start_worker

# Tokens of the low-priority stream: long enough to be running when urgent comes (400 once
# ended, on the tiny model, before an urgent request slowed by a busy machine arrived).
LONG = 900


@pytest.fixture(scope="module")
def servers(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, Proc, str]]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(
        "batch:sk-batch-key\ninteractive:sk-interactive-key\n"
        "  # a tenant that may not jump ahead of anyone at priority 0\n"
        "capped:sk-capped-key priority=0..\n"
    )
    metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
    port = int(metrics_url.split(":")[-1].split("/")[0])
    with (
        start_worker(
            tiny_model_path,
            slots=1,
            ctx_size=1024,
            metrics_port=port,
            scheduling_policy="priority",
            tenant_weight="interactive=2",
        ) as worker,
        start_gateway(tiny_model_path, worker.endpoint, api_key_file=str(keys)) as gateway,
    ):
        yield worker, gateway, metrics_url


def client(gateway: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def test_an_urgent_request_preempts_and_the_stream_resumes_intact(servers) -> None:
    _, gateway, metrics_url = servers
    batch, interactive = client(gateway, "sk-batch-key"), client(gateway, "sk-interactive-key")
    settings = {"model": "tiny-llama", "temperature": 0, "prompt": "once upon a time"}
    alone = batch.completions.create(max_tokens=LONG, extra_body={"ignore_eos": True}, **settings)

    first_chunk = threading.Event()
    streamed: list[str] = []
    ends: dict[str, float] = {}

    def low_priority_stream() -> None:
        stream = batch.completions.create(
            max_tokens=LONG, stream=True, extra_body={"ignore_eos": True, "priority": 5}, **settings
        )
        for chunk in stream:
            if chunk.choices:
                streamed.append(chunk.choices[0].text)
                first_chunk.set()
        ends["low"] = time.monotonic()

    thread = threading.Thread(target=low_priority_stream)
    thread.start()
    assert first_chunk.wait(30)
    urgent = interactive.completions.create(
        max_tokens=4, extra_body={"ignore_eos": True, "priority": -1}, **settings
    )
    ends["urgent"] = time.monotonic()
    thread.join(60)

    assert urgent.usage.completion_tokens == 4
    assert ends["urgent"] < ends["low"]  # it did not wait for the long stream's slot
    assert "".join(streamed) == alone.choices[0].text  # nothing repeated, lost or changed
    metrics = scrape_metrics(metrics_url)
    assert metrics[("loomserve:num_preemptions_total", ())] == 1
    for priority in ("-1", "5"):
        key = ("loomserve:request_queue_time_by_priority_seconds_count", (("priority", priority),))
        assert metrics[key] == 1
    tenants = {
        labels[0][1]
        for name, labels in metrics
        if name == "loomserve:num_requests_running_by_tenant"
    }
    assert tenants == {"batch", "interactive"}  # the keys' names, never the keys
    # The tick-cost model learned from the ticks that ran: a tick costs something.
    cost = {
        labels[0][1]: value
        for (name, labels), value in metrics.items()
        if name == "loomserve:tick_cost_seconds"
    }
    assert cost.keys() == {"base", "decode_token", "prefill_token"}
    assert cost["base"] + cost["decode_token"] > 0


def test_priority_out_of_range_is_a_400(servers) -> None:
    _, gateway, _ = servers
    response = httpx.post(
        gateway.url + "/v1/completions",
        headers={"Authorization": "Bearer sk-batch-key"},
        json={"prompt": "hi", "max_tokens": 2, "priority": 2**40},
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"


def test_a_key_cannot_claim_more_priority_than_its_file_allows(servers) -> None:
    """A request of a key bounded to `priority=0..` that asks for -1000 runs at 0: it does not
    preempt another tenant's stream at 0 (equal priorities never preempt), it waits."""
    _, gateway, metrics_url = servers
    batch, capped = client(gateway, "sk-batch-key"), client(gateway, "sk-capped-key")
    settings = {"model": "tiny-llama", "temperature": 0, "prompt": "once upon a time"}
    by_priority = "loomserve:request_queue_time_by_priority_seconds_count"
    before = scrape_metrics(metrics_url)
    preemptions = before[("loomserve:num_preemptions_total", ())]
    first_chunk = threading.Event()
    finished: list[str | None] = []

    def stream_at_zero() -> None:
        stream = batch.completions.create(
            max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}, **settings
        )
        for chunk in stream:
            if chunk.choices:
                first_chunk.set()
                finished.append(chunk.choices[0].finish_reason)

    thread = threading.Thread(target=stream_at_zero)
    thread.start()
    assert first_chunk.wait(30)
    claimed = capped.completions.create(
        max_tokens=4, extra_body={"ignore_eos": True, "priority": -1000}, **settings
    )
    thread.join(60)
    assert claimed.usage.completion_tokens == 4
    # One slot and no preemption: the capped request waited for the stream, which ran whole.
    # These are the server's facts; the two client threads' clocks cannot order two ends a
    # few milliseconds apart.
    assert finished[-1] == "length"  # all LONG tokens
    metrics = scrape_metrics(metrics_url)
    assert metrics[("loomserve:num_preemptions_total", ())] == preemptions
    at_zero = (by_priority, (("priority", "0"),))
    assert metrics[at_zero] == before.get(at_zero, 0) + 2  # both queued at priority 0
    assert (by_priority, (("priority", "-1000"),)) not in metrics
