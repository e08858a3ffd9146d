"""Several models behind one gateway, on the real engine: two tiny models with different
vocabularies, each served by its own worker; the gateway has neither file and learns both
from their workers. Requests go to the model they name, and answer what that model answers
served alone; a worker for a new model joins the running deployment.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.procs import Proc, free_port, scrape_metrics, start_gateway, start_worker

PROMPTS = ["once upon a time", "the cat said hello to", "what is the answer", "one two three"]
WAIT_SECONDS = 60.0  # for a worker to come up on a loaded machine


@dataclass(slots=True)
class TwoModels:
    a: Proc  # the worker serving "a" (the tiny model)
    b: Proc  # the worker serving "b" (the other one), with embeddings
    gateway: Proc  # knows neither file
    spare: str  # a worker endpoint the gateway knows, where nothing runs yet


@pytest.fixture(scope="module")
def two_models(tiny_model_path: Path, other_model_path: Path) -> Iterator[TwoModels]:
    with ExitStack() as stack:
        a = stack.enter_context(start_worker(tiny_model_path, served_model_name="a"))
        b = stack.enter_context(
            start_worker(other_model_path, served_model_name="b", embeddings=True)
        )
        spare = f"tcp://127.0.0.1:{free_port()}"
        gateway = stack.enter_context(start_gateway(None, [a.endpoint, b.endpoint, spare]))
        wait_until(lambda: states(gateway) == {"a": "loaded", "b": "loaded"}, "both models")
        yield TwoModels(a, b, gateway, spare)


def wait_until(check: Callable[[], bool], what: str, timeout: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def states(gateway: Proc) -> dict[str, str]:
    models = httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]
    return {card["id"]: card["status"]["value"] for card in models}


def complete(url: str, model: str | None, prompt: str, max_tokens: int = 12) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == (model or response.json()["model"])
    return response.json()["choices"][0]["text"]


def alone(model_path: Path, worker: Proc) -> list[str]:
    """Each prompt's greedy text from the worker behind a one-model gateway of its own file."""
    with start_gateway(model_path, worker.endpoint) as gateway:
        return [complete(gateway.url, None, prompt) for prompt in PROMPTS]


def test_each_request_runs_on_the_model_it_names(
    two_models: TwoModels, tiny_model_path: Path, other_model_path: Path
) -> None:
    """Concurrent requests to both models answer what each model answers served alone."""
    expected = {
        "a": alone(tiny_model_path, two_models.a),
        "b": alone(other_model_path, two_models.b),
    }
    assert expected["a"] != expected["b"]  # two models that say different things
    jobs = [(model, i) for i in range(len(PROMPTS)) for model in ("a", "b")] * 2
    with ThreadPoolExecutor(max_workers=8) as pool:
        texts = list(
            pool.map(lambda job: complete(two_models.gateway.url, job[0], PROMPTS[job[1]]), jobs)
        )
    for (model, i), text in zip(jobs, texts, strict=True):
        assert text == expected[model][i], (model, i)


def test_models_are_listed_with_their_state(two_models: TwoModels) -> None:
    url = two_models.gateway.url
    cards = {card["id"]: card for card in httpx.get(url + "/v1/models").json()["data"]}
    assert set(cards) == {"a", "b"}
    assert cards["a"]["max_model_len"] == 512 and cards["a"]["status"] == {"value": "loaded"}
    one = httpx.get(url + "/v1/models/b").json()
    assert one["id"] == "b" and one["status"]["value"] == "loaded"
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["models"] == {"a": "loaded", "b": "loaded"}


def test_an_unknown_model_is_404_in_each_api_shape(two_models: TwoModels) -> None:
    url = two_models.gateway.url
    openai_answer = httpx.post(url + "/v1/completions", json={"model": "zz", "prompt": "hi"})
    assert openai_answer.status_code == 404
    error = openai_answer.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "`a`" in error["message"] and "`b`" in error["message"]
    chat = {"model": "zz", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url + "/v1/chat/completions", json=chat).status_code == 404
    assert httpx.get(url + "/v1/models/zz").status_code == 404
    message = {"model": "zz", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    anthropic = httpx.post(url + "/v1/messages", json=message)
    assert anthropic.status_code == 404
    assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"]
    for path, body in [("/tokenize", {"content": "hi"}), ("/v1/embeddings", {"input": "hi"})]:
        assert httpx.post(url + path, json={**body, "model": "zz"}).status_code == 404
    # With two models, a request must say which.
    nameless = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert nameless.status_code == 400 and nameless.json()["error"]["param"] == "model"


def test_every_endpoint_honours_the_model(two_models: TwoModels) -> None:
    url = two_models.gateway.url

    def tokens(model: str) -> list[int]:
        body = {"model": model, "content": "w5 hello"}
        return httpx.post(url + "/tokenize", json=body).json()["tokens"]

    # " w5" is one piece of b's vocabulary and several of a's.
    assert len(tokens("b")) < len(tokens("a"))
    text = httpx.post(url + "/detokenize", json={"model": "b", "tokens": tokens("b")}).json()
    assert text["content"].strip() == "w5 hello"
    chat = {
        "model": "b",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    answer = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert answer.status_code == 200 and answer.json()["model"] == "b"
    response = httpx.post(
        url + "/v1/responses", json={"model": "a", "input": "hello", "max_output_tokens": 4}
    )
    assert response.status_code == 200 and response.json()["model"] == "a"
    message = {"model": "b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    anthropic = httpx.post(url + "/v1/messages", json=message, timeout=60)
    assert anthropic.status_code == 200 and anthropic.json()["model"] == "b"
    embedded = httpx.post(url + "/v1/embeddings", json={"model": "b", "input": ["hello"]})
    assert embedded.status_code == 200 and embedded.json()["model"] == "b"
    # The request metrics say which model served what.
    samples = scrape_metrics(url + "/metrics")
    served = {
        dict(labels)["model_name"]
        for (name, labels), value in samples.items()
        if name == "loomserve:request_success_total" and value > 0
    }
    assert served == {"a", "b"}
    assert samples[("loomserve:model_state", (("model_name", "b"), ("state", "loaded")))] == 1


def test_a_gateway_without_a_manager_cannot_load_models(two_models: TwoModels) -> None:
    answer = httpx.post(two_models.gateway.url + "/models/load", json={"model": "a"})
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "models_not_managed"


def test_a_worker_for_a_new_model_joins_the_running_deployment(
    two_models: TwoModels, tiny_model_path: Path
) -> None:
    """A worker started where the gateway already looks: its model appears by its own name,
    the vocabulary it needs comes from the worker, and requests for it are served."""
    port = int(two_models.spare.rsplit(":", 1)[1])
    with start_worker(tiny_model_path, port=port, served_model_name="c") as c:
        assert c.endpoint == two_models.spare
        wait_until(lambda: states(two_models.gateway).get("c") == "loaded", "model c")
        assert complete(two_models.gateway.url, "c", PROMPTS[0]) == complete(
            two_models.gateway.url, "a", PROMPTS[0]
        )  # the same file under another name
    wait_until(lambda: states(two_models.gateway).get("c") != "loaded", "model c to leave")
    gone = httpx.post(
        two_models.gateway.url + "/v1/completions", json={"model": "c", "prompt": "x"}
    )
    assert gone.status_code == 503
    # /v1/models says why, as the 503 does; not a failed load, so no `failed` mark.
    card = httpx.get(two_models.gateway.url + "/v1/models/c").json()
    assert card["status"]["value"] == "unavailable" and "failed" not in card["status"]
    assert card["status"]["reason"] == gone.json()["error"]["message"]


def test_the_status_page_shows_each_model(browser, two_models: TwoModels) -> None:
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(two_models.gateway.url + "/status")
    page.wait_for_selector("#models-section:not([hidden])", timeout=15_000)
    page.wait_for_function(
        "document.querySelectorAll('#models tbody tr').length >= 2", timeout=15_000
    )
    rows = [line.split("\t") for line in page.inner_text("#models tbody").splitlines()]
    expected = {name: state for name, state in states(two_models.gateway).items()}
    assert dict(rows) == expected and expected["a"] == expected["b"] == "loaded"
    assert "b" in page.inner_text("#workers")  # each worker under its model's name
    page.close()
    assert errors == []
