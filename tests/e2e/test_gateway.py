"""End to end: a real worker on the tiny model and two gateway processes, driven by `openai`."""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import Proc, Samples, free_port, scrape_metrics, start_gateway, start_worker

SLOTS = 4
CTX = 512
# The second gateway overrides the chat template (the tiny model has none: ChatML then).
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PROMPTS = [
    "once upon a time",
    "the cat and the dog",
    "hello world",
    "tell me a story",
    "what is the answer",
    "a small house by the river",
    "one two three four",
    "why is the tree big",
]


@pytest.fixture(scope="module")
def worker_metrics_url() -> str:
    return f"http://127.0.0.1:{free_port()}/metrics"


@pytest.fixture(scope="module")
def worker(tiny_model_path: Path, worker_metrics_url: str) -> Iterator[Proc]:
    port = int(worker_metrics_url.split(":")[-1].split("/")[0])
    with start_worker(tiny_model_path, slots=SLOTS, ctx_size=CTX, metrics_port=port) as proc:
        yield proc


@pytest.fixture(scope="module")
def gateways(
    tiny_model_path: Path, worker: Proc, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, Proc]]:
    """Two gateways sharing a Prometheus multiprocess directory, as `loomserve serve` runs them."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path_factory.mktemp("prometheus"))}
    with (
        start_gateway(tiny_model_path, worker.endpoint, env=env) as first,
        start_gateway(tiny_model_path, worker.endpoint, env=env, chat_template=TEMPLATE) as second,
    ):
        print("logs:", worker.log_path, first.log_path, second.log_path)
        yield first, second


def client(gateway: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def greedy(gateway: Proc, prompt: str, max_tokens: int = 24, **extra: object):
    return client(gateway).completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )


def streamed_text(gateway: Proc, prompt: str, max_tokens: int = 24) -> str:
    stream = client(gateway).completions.create(
        model="tiny-llama",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def wait_all_slots_free(gateway: Proc, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(gateway.url + "/health").json()
        if health.get("slots_idle") == SLOTS and health.get("queue_depth") == 0:
            return health
        assert time.monotonic() < deadline, f"slots still busy: {health}"
        time.sleep(0.05)


def test_models_health_and_openapi(gateways: tuple[Proc, Proc]) -> None:
    gateway = gateways[0]
    models = client(gateway).models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert models.data[0].model_extra["max_model_len"] == CTX
    assert httpx.get(gateway.url + "/live").json() == {"status": "ok"}
    health = wait_all_slots_free(gateway)
    assert health["status"] == "ok"
    spec = httpx.get(gateway.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= spec["paths"].keys()


@pytest.mark.parametrize(
    ("page", "assets"),
    [
        ("/docs", ["swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"]),
        ("/redoc", ["redoc.standalone.js", "favicon.png"]),
    ],
)
def test_the_api_pages_load_nothing_from_elsewhere(
    gateways: tuple[Proc, Proc], page: str, assets: list[str]
) -> None:
    """FastAPI's own /docs and /redoc load their scripts from a CDN: blank pages offline."""
    html = httpx.get(gateways[0].url + page, timeout=10)
    assert html.status_code == 200, html.text
    sources = re.findall(r'(?:src|href)="([^"]+)"', html.text)
    assert sources and all(source.startswith("/") for source in sources), sources
    assert "/openapi.json" in html.text
    for asset in assets:
        assert f"/docs-assets/{asset}" in sources
        served = httpx.get(f"{gateways[0].url}/docs-assets/{asset}", timeout=10)
        assert served.status_code == 200 and len(served.content) > 1000


def test_every_log_line_is_structured(gateways: tuple[Proc, Proc], worker: Proc) -> None:
    """llama.cpp's own lines (the gateway's vocabulary load printed them raw on stderr) go
    through structlog too: one JSON object a line, with a level."""
    for proc in (*gateways, worker):
        lines = [line for line in proc.logs().splitlines() if line.strip()]
        assert lines and all(line.startswith("{") for line in lines), proc.log_tail()
        assert all("level" in json.loads(line) for line in lines)


def test_completion(gateways: tuple[Proc, Proc]) -> None:
    tokens = httpx.post(gateways[0].url + "/tokenize", json={"content": PROMPTS[0]}).json()
    result = greedy(gateways[0], PROMPTS[0], max_tokens=12)
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    choice = result.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert result.usage.completion_tokens == 12
    # The prompt is tokenized with BOS, which /tokenize leaves out by default.
    assert result.usage.prompt_tokens == len(tokens["tokens"]) + 1
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12
    # The worker evaluates at least the prompt's last token, however much of it is cached.
    assert result.usage.prompt_tokens_details.cached_tokens < result.usage.prompt_tokens
    # Greedy is deterministic, across gateways and between streaming and not.
    again = greedy(gateways[1], PROMPTS[0], max_tokens=12)
    assert again.choices[0].text == choice.text
    # The same prompt again finds its prefix in the worker's cache.
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert streamed_text(gateways[1], PROMPTS[0], max_tokens=12) == choice.text


def test_completion_from_token_ids(gateways: tuple[Proc, Proc]) -> None:
    tokenized = httpx.post(
        gateways[0].url + "/tokenize", json={"content": PROMPTS[1], "add_special": True}
    ).json()["tokens"]
    by_text = greedy(gateways[0], PROMPTS[1], max_tokens=8).choices[0].text
    by_ids = client(gateways[0]).completions.create(
        model="tiny-llama", prompt=tokenized, max_tokens=8, temperature=0
    )
    assert by_ids.choices[0].text == by_text


def test_streaming_usage_and_done(gateways: tuple[Proc, Proc]) -> None:
    body = {
        "prompt": PROMPTS[2],
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", gateways[0].url + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_chat(gateways: tuple[Proc, Proc]) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}],
        },
    ]
    chat = client(gateways[0]).chat.completions
    result = chat.create(model="tiny-llama", messages=messages, max_tokens=10, temperature=0)
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.usage.completion_tokens <= 10

    stream = chat.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == result.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == result.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == result.choices[0].finish_reason


def test_chat_template_override(gateways: tuple[Proc, Proc]) -> None:
    """Chat through the override template equals a completion of the text it renders."""
    chat = client(gateways[1]).chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "system", "content": "hi"}, {"role": "user", "content": "hello"}],
        max_tokens=12,
        temperature=0,
    )
    completion = client(gateways[0]).completions.create(
        model="tiny-llama",
        prompt="system: hi\nuser: hello\nassistant:",
        max_tokens=12,
        temperature=0,
    )
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens
    assert chat.choices[0].message.content == completion.choices[0].text


def test_chat_max_tokens_defaults_to_the_context(gateways: tuple[Proc, Proc]) -> None:
    result = client(gateways[0]).chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "tell me a story"}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    usage = result.usage
    assert result.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == CTX


def test_concurrent_streams_match_solo_runs(gateways: tuple[Proc, Proc]) -> None:
    """8 greedy streams at once, split over both gateways, each equal to its solo run."""
    solo = [greedy(gateways[0], p, max_tokens=32).choices[0].text for p in PROMPTS]
    assert len(set(solo)) > 1

    def run(index: int) -> str:
        return streamed_text(gateways[index % 2], PROMPTS[index], max_tokens=32)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(run, range(len(PROMPTS))))
    assert together == solo


def test_stop_strings(gateways: tuple[Proc, Proc]) -> None:
    full = greedy(gateways[0], PROMPTS[3], max_tokens=40).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    result = greedy(gateways[0], PROMPTS[3], max_tokens=40, stop=[stop, "never-there"])
    assert result.choices[0].text == expected
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens < 40
    stream = client(gateways[1]).completions.create(
        model="tiny-llama",
        prompt=PROMPTS[3],
        max_tokens=40,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_all_slots_free(gateways[0])


def test_seeded_sampling_is_reproducible(gateways: tuple[Proc, Proc]) -> None:
    def sample(gateway: Proc) -> str:
        return (
            client(gateway)
            .completions.create(
                model="tiny-llama", prompt=PROMPTS[4], max_tokens=16, temperature=1.0, seed=42
            )
            .choices[0]
            .text
        )

    assert sample(gateways[0]) == sample(gateways[1])


def test_json_schema_response_format(gateways: tuple[Proc, Proc]) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"],
    }
    result = client(gateways[0]).chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "answer in json"}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    value = json.loads(result.choices[0].message.content)
    assert set(value) == {"ok", "n"}
    assert isinstance(value["ok"], bool) and isinstance(value["n"], int)
    assert result.choices[0].finish_reason == "stop"


def test_json_object_response_format(gateways: tuple[Proc, Proc]) -> None:
    result = client(gateways[1]).completions.create(
        model="tiny-llama",
        prompt="answer in json",  # greedy, the tiny model closes this object within 300 tokens
        max_tokens=300,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert result.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(result.choices[0].text), dict)


def test_tokenize_detokenize(gateways: tuple[Proc, Proc]) -> None:
    url = gateways[0].url
    tokens = httpx.post(url + "/tokenize", json={"content": "hello world"}).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": tokens}).json() == {
        "content": " hello world"
    }
    with_bos = httpx.post(url + "/tokenize", json={"content": "hi", "add_special": True}).json()
    assert with_bos["tokens"][0] == 1
    pieces = httpx.post(url + "/tokenize", json={"content": "hello", "with_pieces": True}).json()
    hello = httpx.post(url + "/tokenize", json={"content": "hello"}).json()["tokens"]
    assert [p["id"] for p in pieces["tokens"]] == hello
    assert "".join(p["piece"] for p in pieces["tokens"]) == " hello"


def test_metrics_cover_both_gateways(gateways: tuple[Proc, Proc]) -> None:
    def completions_served(gateway: Proc) -> float:
        text = httpx.get(gateway.url + "/metrics").text
        line = 'loomserve:http_requests_total{route="/v1/completions",status="200"} '
        return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])

    before = completions_served(gateways[0])
    greedy(gateways[1], PROMPTS[6], max_tokens=4)
    assert completions_served(gateways[0]) == before + 1  # served by the other gateway
    text = httpx.get(gateways[0].url + "/metrics").text
    for name in [
        'loomserve:http_requests_total{route="/v1/completions",status="200"}',
        "loomserve:time_to_first_token_seconds_bucket",
        "loomserve:inter_token_latency_seconds_bucket",
        "loomserve:e2e_request_latency_seconds_count",
        "loomserve:request_queue_time_seconds_count",
        "loomserve:worker_rtt_seconds_count",
        "loomserve:requests_in_flight",
        "loomserve:generation_tokens_total",
        "loomserve:prompt_tokens_total",
    ]:
        assert name in text, name


def test_metrics_move_by_what_was_served(
    gateways: tuple[Proc, Proc], worker_metrics_url: str
) -> None:
    """Token counters equal the usage the clients got, on the gateways' shared /metrics and
    the worker's; scrapes during traffic see the counters only grow; a bad request is a 400."""
    first = gateways[0]
    wait_all_slots_free(first)
    gateway_before = scrape_metrics(first.url + "/metrics")
    worker_before = scrape_metrics(worker_metrics_url)
    model = (("model_name", "tiny-llama"),)  # the gateway's request metrics are by model
    generated = "loomserve:generation_tokens_total", model

    def request(i: int) -> dict:
        if i % 3 == 0:  # streamed, with usage in the last event
            stream = client(gateways[i % 2]).completions.create(
                model="tiny-llama",
                prompt=PROMPTS[i],
                max_tokens=40 + i,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            return [chunk for chunk in stream][-1].usage.model_dump()
        return greedy(gateways[i % 2], PROMPTS[i], max_tokens=40 + i).usage.model_dump()

    during: list[float] = []
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(request, i) for i in range(8)]
        while not all(f.done() for f in futures):
            during.append(scrape_metrics(first.url + "/metrics")[generated])
        usages = [f.result() for f in futures]
    too_long = httpx.post(
        first.url + "/v1/completions", json={"prompt": "hello " * 2000, "max_tokens": 4}
    )
    assert too_long.status_code == 400
    gateway_after = scrape_metrics(first.url + "/metrics")
    worker_after = scrape_metrics(worker_metrics_url)

    def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    completion_tokens = sum(u["completion_tokens"] for u in usages)
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    assert completion_tokens == sum(40 + i for i in range(8))
    assert during == sorted(during)
    assert all(gateway_before[generated] <= seen <= gateway_after[generated] for seen in during)
    gateway_moved = functools.partial(moved, gateway_before, gateway_after, model_name="tiny-llama")
    assert gateway_moved("loomserve:generation_tokens_total") == completion_tokens
    assert moved(worker_before, worker_after, "loomserve:generation_tokens_total") == (
        completion_tokens
    )
    assert gateway_moved("loomserve:prompt_tokens_total") == prompt_tokens
    # Both count every prompt token; the worker evaluated those its prefix cache lacked.
    assert moved(worker_before, worker_after, "loomserve:prompt_tokens_total") == prompt_tokens
    batch = "loomserve:batch_tokens_total"
    evaluated = moved(worker_before, worker_after, batch, kind="prefill")
    cached = moved(worker_before, worker_after, "loomserve:prefix_cache_hits_total")
    assert evaluated + cached == prompt_tokens
    assert moved(worker_before, worker_after, "loomserve:prefix_cache_queries_total") == (
        prompt_tokens
    )
    route = "/v1/completions"
    http = "loomserve:http_requests_total"
    assert moved(gateway_before, gateway_after, http, route=route, status="200") == 8
    assert moved(gateway_before, gateway_after, http, route=route, status="400") == 1
    latency = "loomserve:e2e_request_latency_seconds_count"
    assert gateway_moved(latency) == 8
    assert gateway_after["loomserve:requests_in_flight", model] == 0
    finished = "loomserve:requests_finished_total"
    assert moved(worker_before, worker_after, finished, finished_reason="length") == 8
    # Bad input never reached the worker.
    assert moved(worker_before, worker_after, "loomserve:requests_rejected_total") == 0


def test_the_gateways_metrics_carry_the_workers_load(
    gateways: tuple[Proc, Proc], worker: Proc, worker_metrics_url: str
) -> None:
    """Under `serve` the worker has no metrics port unless given one: each gateway's /metrics
    shows its slots, queue and KV cache, labelled by worker, from its heartbeats."""
    gateway = gateways[0]
    greedy(gateway, "the worker's load", max_tokens=8)
    wait_all_slots_free(gateway)
    labels = (("worker", worker.endpoint),)
    own = scrape_metrics(worker_metrics_url)  # idle now: nothing changes it
    expected = {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "free_slots": float(SLOTS),
        "kv_cache_usage_perc": own[("loomserve:kv_cache_usage_perc", ())],
    }
    assert 0 < expected["kv_cache_usage_perc"] < 1  # the cells kept for prefix reuse

    def seen() -> dict[str, float | None]:
        samples = scrape_metrics(gateway.url + "/metrics")
        return {name: samples.get((f"loomserve:worker_{name}", labels)) for name in expected}

    deadline = time.monotonic() + 30  # a heartbeat a second; generous for a loaded machine
    while (found := seen()) != expected:
        assert time.monotonic() < deadline, f"{found} != {expected}"
        time.sleep(0.2)


def test_the_metrics_doc_lists_every_metric(
    gateways: tuple[Proc, Proc], worker_metrics_url: str
) -> None:
    reference = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    served = {*scrape_metrics(gateways[0].url + "/metrics"), *scrape_metrics(worker_metrics_url)}
    names = {histogram_name(name) for name, _ in served if not name.endswith("_created")}
    missing = sorted(n for n in names if f"`{n}`" not in reference and f"`{n}{{" not in reference)
    assert not missing, f"docs/metrics.md does not describe {missing}"


def histogram_name(sample: str) -> str:
    """The metric a sample belongs to: a histogram's name for its _bucket, _count and _sum."""
    for suffix in ("_bucket", "_count", "_sum"):
        if sample.endswith(suffix):
            return sample.removesuffix(suffix)
    return sample
