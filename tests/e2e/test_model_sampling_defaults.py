"""A GGUF's own sampling defaults (general.sampling.*) fill the fields a request leaves out, as
vLLM's generation_config does; a field the request sets wins; --no-model-sampling-defaults turns
them off. Real gateway and worker on the tiny model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loomserve.gateway.request.params import model_sampling_defaults
from tests.procs import Proc, start_gateway, start_worker
from tests.tiny_model import write_tiny_model

PROMPT = "the cat and the dog"


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, saying that it samples greedily unless asked otherwise."""
    path = tmp_path_factory.mktemp("sampling") / "tiny-greedy.gguf"
    return write_tiny_model(path, sampling={"temp": 0.0, "top_k": 7, "top_p": 0.9})


@pytest.fixture(scope="module")
def servers(greedy_model: Path) -> Iterator[tuple[Proc, Proc]]:
    with (
        start_worker(greedy_model) as worker,
        start_gateway(greedy_model, worker.endpoint) as with_defaults,
        start_gateway(greedy_model, worker.endpoint, model_sampling_defaults=False) as neutral,
    ):
        yield with_defaults, neutral


def start_up_line(gateway: Proc) -> dict:
    """The gateway's start-up log line naming the sampling defaults in force."""
    for line in gateway.logs().splitlines():
        if '"sampling defaults"' in line:
            entry = json.loads(line)
            entry["top_p"] = round(entry["top_p"], 6)  # float32 in the GGUF
            return entry
    raise AssertionError("no 'sampling defaults' line in the gateway's log")


def complete(gateway: Proc, **fields: object) -> str:
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, **fields}
    response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_the_models_temperature_fills_a_request_that_sets_none(servers) -> None:
    with_defaults, _ = servers
    greedy = complete(with_defaults, temperature=0)
    assert {complete(with_defaults) for _ in range(3)} == {greedy}
    logged = start_up_line(with_defaults)
    assert logged["temperature"] == 0.0 and logged["top_k"] == 7 and logged["top_p"] == 0.9
    assert logged["source"].startswith("the model")


def test_a_field_the_request_sets_wins(servers) -> None:
    with_defaults, _ = servers
    sampled = {complete(with_defaults, temperature=1.5, top_k=0, top_p=1.0) for _ in range(6)}
    assert len(sampled) > 1


def test_the_option_turns_them_off(servers) -> None:
    _, neutral = servers
    assert len({complete(neutral) for _ in range(6)}) > 1
    logged = start_up_line(neutral)
    assert logged["temperature"] == 1.0 and "--no-model-sampling-defaults" in logged["source"]


def test_values_that_do_not_parse_or_check_are_left_out() -> None:
    meta = {
        "general.sampling.temp": "0.7",
        "general.sampling.top_k": "40",
        "general.sampling.top_p": "1.5",  # out of range: neutral
        "general.sampling.min_p": "a lot",  # not a number
        "general.sampling.penalty_last_n": "-1",
    }
    found = model_sampling_defaults(lambda key: meta.get(key, ""))
    assert found == {"temperature": 0.7, "top_k": 40, "repeat_last_n": -1}
