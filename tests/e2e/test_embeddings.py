"""/v1/embeddings end to end: a worker with --embeddings on the tiny model (mean pooling),
through `openai`, LangChain and litellm; and a worker without it, which answers 400."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.procs import Proc, start_gateway, start_worker

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price list from the internet

import litellm
from langchain_openai import OpenAIEmbeddings

TEXTS = ["the cat and the dog", "hello world", "once upon a time there lived a small cat"]
SIZE = 64  # the tiny model's n_embd


def assert_same_embedding(alone: list[float], batched: np.ndarray | list[float]) -> None:
    """What is promised with batch invariance (the default): bit-equal alone and batched."""
    alone_f32 = np.asarray(alone, dtype=np.float32)
    batched_f32 = np.asarray(batched, dtype=np.float32)
    difference = np.max(np.abs(alone_f32 - batched_f32))
    assert np.array_equal(alone_f32, batched_f32), f"differs by {difference:g}"


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, slots=2, embeddings=True) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        yield gateway


def client(gateway: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_gets_unit_vectors_in_order(gateway: Proc) -> None:
    # Without encoding_format the client asks for base64 and decodes it itself.
    result = client(gateway).embeddings.create(model="tiny-llama", input=TEXTS)
    assert result.object == "list" and result.model == "tiny-llama"
    assert [d.index for d in result.data] == [0, 1, 2]
    first = np.array([d.embedding for d in result.data])
    assert first.shape == (3, SIZE)
    assert np.allclose(np.linalg.norm(first, axis=1), 1.0, atol=1e-5)
    assert result.usage.prompt_tokens == result.usage.total_tokens > len(TEXTS)
    floats = client(gateway).embeddings.create(
        model="tiny-llama", input=TEXTS, encoding_format="float"
    )
    assert np.allclose([d.embedding for d in floats.data], first, atol=1e-6)
    raw = httpx.post(
        gateway.url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    # The same input in the same batch composition: bit-equal, whatever the encoding.
    floats_alone = client(gateway).embeddings.create(
        model="tiny-llama", input=TEXTS[0], encoding_format="float"
    )
    assert np.array_equal(decoded, np.array(floats_alone.data[0].embedding, dtype=np.float32))
    assert not np.allclose(first[0], first[1], atol=1e-3)
    # The promise across batch compositions (docs/api.md, Embeddings): each input alone gets
    # the very vector it got in the batch.
    for index, text in enumerate(TEXTS):
        alone = client(gateway).embeddings.create(model="tiny-llama", input=text)
        assert_same_embedding(alone.data[0].embedding, first[index])


def test_token_ids_and_many_inputs(gateway: Proc) -> None:
    tokens = httpx.post(gateway.url + "/tokenize", json={"content": TEXTS[0], "add_special": True})
    ids = tokens.json()["tokens"]
    by_ids = client(gateway).embeddings.create(model="tiny-llama", input=[ids])
    by_text = client(gateway).embeddings.create(model="tiny-llama", input=TEXTS[0])
    # The same tokens, the same composition: bit-equal.
    assert by_ids.data[0].embedding == by_text.data[0].embedding
    # More inputs than one batch holds (32 sequences): they run over several ticks.
    many = [f"{text} {i}" for i in range(30) for text in TEXTS]
    result = client(gateway).embeddings.create(model="tiny-llama", input=many)
    assert len(result.data) == len(many)
    again = client(gateway).embeddings.create(model="tiny-llama", input=many[-1])
    assert_same_embedding(again.data[0].embedding, result.data[-1].embedding)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 10**6]]}, "input"),
        ({"input": "a", "dimensions": 8}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "the " * 600}, None),  # longer than one embedding batch
    ],
)
def test_bad_embedding_requests_get_400(gateway: Proc, body: dict, param: str | None) -> None:
    response = httpx.post(gateway.url + "/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    if param:
        assert response.json()["error"]["param"] == param


def test_langchain_embeddings(gateway: Proc) -> None:
    embedder = OpenAIEmbeddings(
        model="tiny-llama",
        base_url=gateway.url + "/v1",
        api_key="unused",
        check_embedding_ctx_length=False,  # else it tokenizes with tiktoken's OpenAI vocab
    )
    vectors = embedder.embed_documents(TEXTS)
    query = embedder.embed_query(TEXTS[2])
    assert len(vectors) == 3 and len(query) == SIZE
    assert np.allclose(vectors[2], query, atol=1e-4)


def test_litellm_embedding(gateway: Proc) -> None:
    response = litellm.embedding(
        model="openai/tiny-llama", api_base=gateway.url + "/v1", api_key="unused", input=TEXTS
    )
    vectors = [item["embedding"] for item in response.data]
    assert len(vectors) == 3 and len(vectors[0]) == SIZE


def test_without_embeddings_the_endpoint_answers_400(tiny_model_path: Path) -> None:
    with (
        start_worker(tiny_model_path, slots=1) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        response = httpx.post(gateway.url + "/v1/embeddings", json={"input": "hello"})
        assert response.status_code == 400
        assert "--embeddings" in response.json()["error"]["message"]
        # Generation is untouched.
        completion = httpx.post(
            gateway.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}
        )
        assert completion.status_code == 200


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model declaring rank pooling: llama.cpp writes n_cls_out floats (here 1) a
    sequence, not n_embd."""
    from tests.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("reranker") / "tiny-reranker.gguf", pooling=4)


def test_a_reranker_returns_its_scores_and_nothing_beyond_them(reranker_path: Path) -> None:
    """Rank pooling: each input's score (n_cls_out floats, as llama.cpp wrote them, not
    normalized), the same for the same input every time; never the memory past them (which
    came back as a 64-float vector of heap bytes, different each time, then a NaN and a 500)."""
    with (
        start_worker(reranker_path, slots=2, embeddings=True) as worker,
        start_gateway(reranker_path, worker.endpoint) as gateway,
    ):
        body = {"model": "tiny-reranker", "input": TEXTS, "encoding_format": "float"}
        answers = [
            httpx.post(gateway.url + "/v1/embeddings", json=body, timeout=60) for _ in range(3)
        ]
        assert all(a.status_code == 200 for a in answers), answers[0].text
        vectors = [[d["embedding"] for d in a.json()["data"]] for a in answers]
        assert all(len(v) == 1 for v in vectors[0])  # the tiny llama has one classifier output
        assert vectors[0] == vectors[1] == vectors[2]
        assert all(np.isfinite(v).all() for v in vectors[0])
        # A score, not a direction: not scaled to length 1.
        assert any(abs(abs(v[0]) - 1.0) > 1e-3 for v in vectors[0])
