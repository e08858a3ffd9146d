"""Reasoning through the clients people use, against the tiny model served with Qwen3's
template (its output forced to a think block and an answer by a grammar) and Qwen3.5's (which
opens the block in the prompt): litellm's reasoning_content, LangChain's ChatOpenAI over the
Responses API (reasoning content blocks), and the Anthropic SDK's thinking blocks."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.procs import Proc, start_gateway, start_worker

# litellm fetches its model price list from the internet at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import anthropic
import langchain_openai
import litellm

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "templates"
MODEL = "tiny-llama"
OUTPUT = "<think>\nabc, then def\n</think>\n\nThe answer."
GRAMMAR = f"root ::= {json.dumps(OUTPUT)}"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def gateways(tiny_model_path: Path) -> Iterator[tuple[Proc, Proc]]:
    qwen3, qwen35 = TEMPLATES / "Qwen-Qwen3-0.6B.jinja", TEMPLATES / "Qwen3.5-4B.jinja"
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=1024) as worker,
        start_gateway(tiny_model_path, worker.endpoint, chat_template=qwen3) as first,
        start_gateway(tiny_model_path, worker.endpoint, chat_template=qwen35) as second,
    ):
        yield first, second


def test_litellm_reads_reasoning_content(gateways: tuple[Proc, Proc]) -> None:
    fields = {
        "model": f"openai/{MODEL}",
        "api_base": gateways[0].url + "/v1",
        "api_key": "unused",
        "temperature": 0,
        "max_tokens": 64,
        "extra_body": {"grammar": GRAMMAR},
    }
    reply = litellm.completion(messages=MESSAGES, **fields)
    message = reply.choices[0].message
    assert message.content == "The answer."
    assert message.reasoning_content == "abc, then def"
    stream = litellm.completion(messages=MESSAGES, stream=True, **fields)
    thought = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in stream)
    assert thought == "abc, then def"


def test_langchain_reads_reasoning_items_of_the_responses_api(
    gateways: tuple[Proc, Proc],
) -> None:
    chat = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=gateways[1].url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=8,
        max_retries=0,
        use_responses_api=True,
    )
    reply = chat.invoke("Say something.")
    (block,) = [b for b in reply.content if isinstance(b, dict) and b.get("type") == "reasoning"]
    # The same thinking as the chat completion's reasoning_content.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    chat_reply = httpx.post(gateways[1].url + "/v1/chat/completions", json=body, timeout=30)
    thought = chat_reply.json()["choices"][0]["message"]["reasoning_content"]
    assert block["content"] == [{"type": "reasoning_text", "text": thought}]


def test_the_anthropic_sdk_reads_thinking_blocks(gateways: tuple[Proc, Proc]) -> None:
    client = anthropic.Anthropic(base_url=gateways[1].url, api_key="unused", max_retries=0)
    fields = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": MESSAGES,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": {"temperature": 0},  # this SDK's create() no longer takes it
    }
    message = client.messages.create(**fields)
    assert [block.type for block in message.content] == ["thinking"]
    thought = message.content[0].thinking
    assert thought
    with client.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.thinking) for b in final.content] == [("thinking", thought)]


def test_the_agents_sdk_calls_a_tool_after_thinking(gateways: tuple[Proc, Proc]) -> None:
    """The Agents SDK over chat completions, against Qwen3's template: the reply (forced) thinks
    with a call-like text in its thinking, then calls; the SDK runs that one call."""
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_time(city: str) -> str:
        """The time in a city."""
        asked.append(city)
        return f"noon in {city}"

    call = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
    output = f"<think>\nI could write {call} here, but I only think it.\n</think>\n\n{call}"
    model = OpenAIChatCompletionsModel(
        model=MODEL,
        openai_client=openai.AsyncOpenAI(
            base_url=gateways[0].url + "/v1", api_key="unused", max_retries=0
        ),
    )
    settings = ModelSettings(
        temperature=0, max_tokens=256, extra_body={"grammar": f"root ::= {json.dumps(output)}"}
    )
    agent = Agent(
        name="clock",
        instructions="Tell the time.",
        tools=[get_time],
        model=model,
        model_settings=settings,
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "What time is it in Paris?", max_turns=2)
    assert asked == ["Paris"]
    assert result.final_output == "noon in Paris"
