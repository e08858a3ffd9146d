"""Tool calls through the clients users run, LangChain and litellm, on the tiny model.

The same server as test_tools.py (generic format, the grammar forcing the call);
each client must turn the reply into its own tool-call objects, in the declared schema.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.e2e.test_tools import ASCII_ONLY, MESSAGES, TOOLS, WEATHER
from tests.procs import Proc, start_gateway, start_worker

# litellm would fetch its model price list from the internet at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
from langchain_core.messages import AIMessageChunk
from langchain_openai import ChatOpenAI


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=1024) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        yield gateway


def chat_model(gateway: Proc, **extra: object) -> ChatOpenAI:
    return ChatOpenAI(
        model="tiny-llama",
        base_url=gateway.url + "/v1",
        api_key="unused",
        temperature=0,  # no max_tokens: the rest of the context (beyond it is a 400)
        max_retries=0,
        logit_bias=ASCII_ONLY,
        **extra,
    )


def test_langchain_bind_tools(gateway: Proc) -> None:
    llm = chat_model(gateway).bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
    message = llm.invoke(MESSAGES[0]["content"])
    assert len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call["name"] in ("get_weather", "lookup") and call["id"]
    if call["name"] == "get_weather":
        jsonschema.validate(call["args"], WEATHER)


def test_langchain_streams_tool_call_chunks(gateway: Proc) -> None:
    llm = chat_model(gateway).bind_tools(
        TOOLS, tool_choice="get_weather", parallel_tool_calls=False
    )
    merged: AIMessageChunk | None = None
    for chunk in llm.stream(MESSAGES[0]["content"]):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and len(merged.tool_calls) == 1, merged
    assert merged.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(merged.tool_calls[0]["args"], WEATHER)


def test_langchain_structured_output_by_function_calling(gateway: Proc) -> None:
    structured = chat_model(gateway).with_structured_output(Weather, method="function_calling")
    weather = structured.invoke("What is the weather in Paris?")
    assert isinstance(weather, Weather)


def test_litellm_tool_call(gateway: Proc) -> None:
    response = litellm.completion(
        model="openai/tiny-llama",
        api_base=gateway.url + "/v1",
        api_key="unused",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        temperature=0,  # no max_tokens: the rest of the context
        logit_bias=ASCII_ONLY,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
