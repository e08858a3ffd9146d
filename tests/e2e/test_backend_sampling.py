"""A worker with --backend-sampling on, behind a real gateway, on the tiny model: seeded
streams repeat whatever runs beside them, and the requests the graph cannot sample (logprobs,
a JSON schema, penalties, n > 1) are served in the same passes on the host path. And one
with the default, which on a CPU draws inside llama_decode (graph_draw.py)."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.procs import Proc, start_gateway, start_worker


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, backend_sampling="on", slots=6) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        yield gateway


def complete(gateway: Proc, **fields: object) -> dict:
    body = {"prompt": "the cat and the dog", "max_tokens": 20, "ignore_eos": True, **fields}
    response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def streamed_text(gateway: Proc, **fields: object) -> str:
    body = {"prompt": "a b c", "max_tokens": 20, "ignore_eos": True, "stream": True, **fields}
    text = []
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(choice["text"] for choice in json.loads(line[6:])["choices"])
    return "".join(text)


def test_seeded_streams_repeat_beside_host_sampled_requests(gateway: Proc) -> None:
    alone = streamed_text(gateway, temperature=1.2, top_k=40, top_p=0.95, seed=11)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    others = [
        {"temperature": 1.0, "logprobs": 2},
        {"temperature": 1.0, "presence_penalty": 1.5},
        {"temperature": 0.8, "n": 2, "seed": 3},
        {
            "temperature": 1.0,
            "max_tokens": 400,
            "ignore_eos": False,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": schema},
            },
        },
    ]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        again = pool.submit(streamed_text, gateway, temperature=1.2, top_k=40, top_p=0.95, seed=11)
        answers = [pool.submit(complete, gateway, **fields) for fields in others]
        assert again.result() == alone
        bodies = [answer.result() for answer in answers]
    assert len(bodies[0]["choices"][0]["logprobs"]["tokens"]) == 20
    assert len(bodies[2]["choices"]) == 2
    assert bodies[3]["choices"][0]["finish_reason"] == "stop"  # the grammar completed
    assert isinstance(json.loads(bodies[3]["choices"][0]["text"])["a"], int)


def test_unseeded_requests_differ_and_greedy_ones_agree(gateway: Proc) -> None:
    texts = {complete(gateway, temperature=1.5)["choices"][0]["text"] for _ in range(4)}
    assert len(texts) > 1
    greedy = {complete(gateway, temperature=0)["choices"][0]["text"] for _ in range(3)}
    assert len(greedy) == 1


def test_a_default_cpu_worker_draws_and_serves_host_path_requests_beside(
    tiny_model_path: Path,
) -> None:
    """A worker with the default --backend-sampling (auto) on a CPU draws inside llama_decode
    (the host's C draw, `draw`) over HTTP: drawn and host-path requests share passes, each
    gets its own kind of answer, seeded ones repeat. (Seeded text alone against batched needs
    batch-invariant logits, which the tiny model's float weights do not give:
    tests/worker/test_default_model.py checks it on Gemma.)"""
    with (
        start_worker(tiny_model_path, slots=6) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        seeded = {"temperature": 1.2, "top_k": 40, "top_p": 0.95, "seed": 11}
        first = streamed_text(gateway, **seeded)
        assert streamed_text(gateway, **seeded) == first
        others = [
            {"temperature": 1.0, "logprobs": 2},
            {"temperature": 1.0, "presence_penalty": 1.5},
            {"temperature": 0.8, "top_p": 0.9, "n": 2, "seed": 3},
            {"temperature": 0.0},
            {"temperature": 1.5},
        ]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            bodies = [b.result() for b in [pool.submit(complete, gateway, **f) for f in others]]
        assert len(bodies[0]["choices"][0]["logprobs"]["tokens"]) == 20
        assert len(bodies[2]["choices"]) == 2
        assert all(body["usage"]["completion_tokens"] >= 20 for body in bodies)
        texts = {complete(gateway, temperature=1.5)["choices"][0]["text"] for _ in range(4)}
        assert len(texts) > 1
        assert '"sampling": "draw"' in worker.logs()
