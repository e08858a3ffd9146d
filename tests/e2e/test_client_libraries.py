"""The clients users run against an OpenAI-compatible server, LangChain and litellm, through
the features they send: chat, streaming, n, logprobs, completions with a prompt list."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Proc, start_gateway, start_worker

# litellm fetches its model price list from the internet at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import langchain_openai
import litellm
from langchain_core.messages import HumanMessage

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, slots=4, ctx_size=512) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as proc,
    ):
        yield proc


def chat_model(gateway: Proc, **fields: object):
    return langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=gateway.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=8,
        max_retries=0,
        **fields,
    )


def test_langchain_chat_stream_n_and_logprobs(gateway: Proc) -> None:
    reply = chat_model(gateway).invoke("hello")
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata["output_tokens"] <= 8
    streamed = "".join(chunk.content for chunk in chat_model(gateway).stream("hello"))
    assert streamed == reply.content
    two = chat_model(gateway, n=2).generate([[HumanMessage("hello")]])
    assert [g.text for g in two.generations[0]] == [reply.content] * 2
    with_logprobs = chat_model(gateway, logprobs=True, top_logprobs=2).invoke("hello")
    content = with_logprobs.response_metadata["logprobs"]["content"]
    assert "".join(entry["token"] for entry in content) == reply.content
    for entry in content:
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])


def test_langchain_completions_with_a_prompt_list(gateway: Proc) -> None:
    llm = langchain_openai.OpenAI(
        model=MODEL,
        base_url=gateway.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=6,
        max_retries=0,
    )
    result = llm.generate(["once upon a time", "hello world"])
    assert len(result.generations) == 2
    assert [g[0].text for g in result.generations] == [
        llm.invoke("once upon a time"),
        llm.invoke("hello world"),
    ]


def litellm_fields(gateway: Proc) -> dict:
    return {
        "model": f"openai/{MODEL}",
        "api_base": gateway.url + "/v1",
        "api_key": "unused",
        "temperature": 0,
        "max_tokens": 8,
    }


def test_litellm_chat_stream_n_and_logprobs(gateway: Proc) -> None:
    fields = litellm_fields(gateway)
    reply = litellm.completion(messages=MESSAGES, **fields)
    text = reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 8
    stream = litellm.completion(messages=MESSAGES, stream=True, **fields)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == text
    two = litellm.completion(messages=MESSAGES, n=2, **fields)
    assert [c.message.content for c in two.choices] == [text, text]
    scored = litellm.completion(messages=MESSAGES, logprobs=True, top_logprobs=2, **fields)
    content = scored.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == text
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)


def test_litellm_text_completion(gateway: Proc) -> None:
    fields = litellm_fields(gateway)
    result = litellm.text_completion(prompt="once upon a time", n=2, **fields)
    texts = [c.text for c in result.choices]
    assert len(texts) == 2 and texts[0] == texts[1]
