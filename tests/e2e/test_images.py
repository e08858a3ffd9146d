"""Images through real processes: a worker with the tiny vision projector (--mmproj) behind a
gateway, asked by the openai and anthropic SDKs and plain HTTP; a text-only worker beside it.
The tiny model and projector are generated (tests/tiny_vision_model.py)."""

from __future__ import annotations

import base64
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.procs import Proc, free_port, scrape_metrics, start_gateway, start_worker, wait_http
from tests.tiny_vision_model import TINY_VISION, png_bytes, png_header

MODEL = "tiny-llama"
MAX_IMAGE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path, tiny_mmproj_path: Path, metrics_port: int) -> Iterator[Proc]:
    projector = {"mmproj": tiny_mmproj_path, "metrics_port": metrics_port}
    with (
        start_worker(tiny_model_path, slots=4, ctx_size=512, **projector) as worker,
        start_gateway(tiny_model_path, worker.endpoint, max_image_bytes=MAX_IMAGE_BYTES) as proc,
    ):
        print("logs:", worker.log_path, proc.log_path)
        yield proc


@pytest.fixture(scope="module")
def text_gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=256) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as proc,
    ):
        yield proc


def data_url(image: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(image).decode()}"


def image_part(image: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def chat(gateway: Proc, *images: bytes, text: str = "what is in it?", **fields: Any):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    content = [*(image_part(image) for image in images), {"type": "text", "text": text}]
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
        **fields,
    )


def post_chat(gateway: Proc, content: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]}
    return httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)


def test_an_image_chat_answers_and_counts_the_image_tokens(gateway: Proc) -> None:
    one = chat(gateway, png_bytes(40, 24, seed=1))
    two = chat(gateway, png_bytes(40, 24, seed=1), png_bytes(24, 40, seed=2))
    assert one.choices[0].message.content and one.usage.completion_tokens == 12
    # The same text: the second image adds exactly its image tokens.
    assert two.usage.prompt_tokens - one.usage.prompt_tokens == TINY_VISION.image_tokens


def test_different_images_different_answers_the_same_image_the_same(gateway: Proc) -> None:
    # Text enough after the image that a hit's re-evaluated tail (batch invariance keeps one,
    # worker/cache/prefix_cache.py) lies past the image.
    text = "what is in it? " + "tell me about the cat and the dog " * 12
    first = chat(gateway, png_bytes(32, 32, seed=3), text=text).choices[0].message.content
    again = chat(gateway, png_bytes(32, 32, seed=3), text=text)  # the first image's slot
    other = chat(gateway, png_bytes(32, 32, seed=4), text=text)  # there too: longest prefix
    assert again.choices[0].message.content == first
    assert other.choices[0].message.content != first
    again_details, other_details = (
        again.usage.prompt_tokens_details,
        other.usage.prompt_tokens_details,
    )
    assert again_details is not None and other_details is not None
    # The same image is served from the cache; another one only the text before it.
    assert again_details.cached_tokens > TINY_VISION.image_tokens
    assert other_details.cached_tokens < again_details.cached_tokens - TINY_VISION.image_tokens


def test_the_worker_counts_images_encoded_cached_and_passed(
    gateway: Proc, metrics_port: int
) -> None:
    url = f"http://127.0.0.1:{metrics_port}/metrics"

    def counts() -> dict[str, float]:
        samples = scrape_metrics(url)
        names = ("images", "image_encoded_cache_hits", "image_tokens", "image_passes")
        return {name: samples.get((f"loomserve:{name}_total", ()), 0.0) for name in names}

    before = counts()
    chat(gateway, png_bytes(30, 30, seed=21), text="first")
    chat(gateway, png_bytes(30, 30, seed=21), text="second")  # the same file: cached
    after = counts()
    moved = {name: after[name] - before[name] for name in after}
    assert moved == {
        "images": 2,
        "image_encoded_cache_hits": 1,
        "image_tokens": 2 * TINY_VISION.image_tokens,
        "image_passes": 2,
    }


def test_models_say_which_take_images(gateway: Proc, text_gateway: Proc) -> None:
    vision = httpx.get(gateway.url + "/v1/models").json()["data"][0]
    text = httpx.get(text_gateway.url + "/v1/models").json()["data"][0]
    assert vision["input_modalities"] == ["text", "image"]
    assert text["input_modalities"] == ["text"]


def test_a_text_only_model_refuses_an_image_naming_the_part(text_gateway: Proc) -> None:
    content = [{"type": "text", "text": "look"}, image_part(png_bytes(32, 32))]
    answer = post_chat(text_gateway, content)
    assert answer.status_code == 400, answer.text
    assert "messages[0].content[1]" in answer.json()["error"]["message"]


BAD_IMAGES = {
    "not-an-image": (image_part(b"hello, I am text"), "not a PNG"),
    "truncated": (image_part(png_bytes(32, 32, seed=1)[:70]), "image 0"),
    "huge": (image_part(png_header(20_000, 20_000)), "20000x20000"),
    "too-many-bytes": (image_part(png_bytes(200, 200, seed=5)), "over"),
    "bad-base64": (
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}},
        "base64",
    ),
    "remote": ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/x.png"}}, "fetched"),
}


def test_bad_images_are_400s_and_other_streams_go_on(gateway: Proc) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    streamed: list[str] = []

    def stream() -> None:
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell me a story"}],
            max_tokens=150,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                streamed.append(chunk.choices[0].delta.content)

    streaming = threading.Thread(target=stream)
    streaming.start()
    try:
        for name, (part, needle) in BAD_IMAGES.items():
            answer = post_chat(gateway, [part, {"type": "text", "text": "what?"}])
            assert answer.status_code == 400, (name, answer.text)
            assert needle in answer.json()["error"]["message"], (name, answer.text)
    finally:
        streaming.join(timeout=60)
    assert not streaming.is_alive() and streamed
    assert chat(gateway, png_bytes(32, 32, seed=6)).choices[0].message.content  # serves on


def test_anthropic_image_blocks_and_responses_input_images(gateway: Proc) -> None:
    image = png_bytes(32, 32, seed=7)
    expected = chat(gateway, image, text="describe it").choices[0].message.content
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    message = claude.messages.create(
        model=MODEL,
        max_tokens=12,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": source},
                    {"type": "text", "text": "describe it"},
                ],
            }
        ],
        extra_body={"ignore_eos": True, "temperature": 0},
    )
    assert message.content[0].text == expected
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    response = client.responses.create(
        model=MODEL,
        max_output_tokens=12,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(image), "detail": "auto"},
                    {"type": "input_text", "text": "describe it"},
                ],
            }
        ],
        extra_body={"ignore_eos": True},
    )
    assert response.output_text == expected


def test_langchains_multimodal_message(gateway: Proc) -> None:
    import langchain_openai
    from langchain_core.messages import HumanMessage

    image = png_bytes(32, 32, seed=12)
    expected = chat(gateway, image, text="describe it").choices[0].message.content
    model = langchain_openai.ChatOpenAI(
        base_url=gateway.url + "/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=12,
        max_retries=0,
        extra_body={"ignore_eos": True},
    )
    message = HumanMessage(
        content=[
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": "describe it"},
        ]
    )
    assert model.invoke([message]).content == expected


@pytest.mark.parametrize("form", ["models-dir", "NAME=PATH"])
def test_serve_pairs_each_model_with_its_projector(
    tiny_model_path: Path, tiny_mmproj_path: Path, tmp_path: Path, form: str
) -> None:
    """--models-dir's mmproj-<model file name>, or --model NAME=PATH with --mmproj NAME=PATH:
    the vision model's worker gets --mmproj, the text one none."""
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model_path, folder / "vision.gguf")
    shutil.copy(tiny_model_path, folder / "text.gguf")
    port = free_port()
    if form == "models-dir":
        shutil.copy(tiny_mmproj_path, folder / "mmproj-vision.gguf")
        args = ["serve", "--models-dir", str(folder)]
    else:
        args = ["serve", "--model", f"vision={folder / 'vision.gguf'}"]
        args += [
            "--model",
            f"text={folder / 'text.gguf'}",
            "--mmproj",
            f"vision={tiny_mmproj_path}",
        ]
    args += ["--port", str(port), "--models-max", "2"]
    args += ["--slots", "2", "--ctx-size", "256", "--threads", "1"]
    args += ["--heartbeat-interval", "0.25", "--worker-timeout", "2"]
    with Proc("serve", args) as proc:
        proc.url = f"http://127.0.0.1:{port}"
        wait_http(proc, "/health")
        listed = httpx.get(proc.url + "/v1/models").json()["data"]
        assert sorted(model["id"] for model in listed) == ["text", "vision"]  # no mmproj model
        content = [image_part(png_bytes(32, 32, seed=40)), {"type": "text", "text": "what?"}]
        for model, status in (("vision", 200), ("text", 400)):
            body = {
                "model": model,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": content}],
            }
            answer = httpx.post(proc.url + "/v1/chat/completions", json=body, timeout=120)
            assert answer.status_code == status, (model, answer.text)
        cards = {card["id"]: card for card in httpx.get(proc.url + "/v1/models").json()["data"]}
        assert cards["vision"]["input_modalities"] == ["text", "image"]
        assert cards["text"]["input_modalities"] == ["text"]


def test_the_count_endpoints_count_image_tokens_as_the_worker_does(
    gateway: Proc, text_gateway: Proc
) -> None:
    image = png_bytes(36, 20, seed=50)
    used = chat(gateway, image, image, text="count me").usage.prompt_tokens
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    block = {"type": "image", "source": source}
    messages = [{"role": "user", "content": [block, block, {"type": "text", "text": "count me"}]}]
    counted = httpx.post(
        gateway.url + "/v1/messages/count_tokens",
        json={"model": MODEL, "messages": messages},
        timeout=60,
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == used
    part = {"type": "input_image", "image_url": data_url(image)}
    content = [part, part, {"type": "input_text", "text": "count me"}]
    counted = httpx.post(
        gateway.url + "/v1/responses/input_tokens",
        json={"model": MODEL, "input": [{"role": "user", "content": content}]},
        timeout=60,
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == used
    # An image the worker cannot decode, and a model that reads none: 400s.
    broken = {**block, "source": {**source, "data": base64.b64encode(image[:70]).decode()}}
    for url, status, needle in (
        (gateway.url, 400, "image 0"),
        (text_gateway.url, 400, "reads no images"),
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": [broken]}]}
        if url == text_gateway.url:
            body["messages"] = messages
        answer = httpx.post(url + "/v1/messages/count_tokens", json=body, timeout=60)
        assert answer.status_code == status, answer.text
        assert needle in answer.json()["error"]["message"], answer.text
