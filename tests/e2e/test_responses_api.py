"""POST /v1/responses end to end: a real worker on the tiny model, driven by the `openai` SDK
(`responses.create`, `responses.stream`) and the OpenAI Agents SDK.

The endpoint is a translation into the chat path, so with greedy sampling its text, calls
and token counts must be the chat endpoint's for the same conversation. The tiny model has
no chat template: tools go into the generic system prompt, and a forced tool_choice's grammar
makes even this random model write a call (of a function whose arguments are an enum, so the
call is fully in the grammar's hands).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest

from tests.procs import Proc, start_gateway, start_worker

MODEL = "tiny-llama"
LOOKUP_PARAMETERS = {
    "type": "object",
    "properties": {"word": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["word"],
    "additionalProperties": False,
}
TOOL: Any = {
    "type": "function",
    "name": "lookup",
    "description": "Look a word up.",
    "parameters": LOOKUP_PARAMETERS,
}
CHAT_TOOL: Any = {
    "type": "function",
    "function": {k: v for k, v in TOOL.items() if k != "type"},
}
QUESTION = "is the sky blue"


@pytest.fixture(scope="module")
def gateway(tiny_model_path: Path) -> Iterator[Proc]:
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=1024) as worker,
        start_gateway(tiny_model_path, worker.endpoint) as gateway,
    ):
        yield gateway


def client(gateway: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)


def test_create_is_the_chat_answer(gateway: Proc) -> None:
    response = client(gateway).responses.create(
        model=MODEL,
        instructions="be brief",
        input=QUESTION,
        max_output_tokens=12,
        temperature=0,
    )
    chat = client(gateway).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
    )
    choice = chat.choices[0]
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == choice.message.content
    expected = "incomplete" if choice.finish_reason == "length" else "completed"
    assert response.status == expected
    if expected == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.store is False


def test_stream_gives_the_same_response_as_create(gateway: Proc) -> None:
    fields: Any = {"model": MODEL, "input": QUESTION, "max_output_tokens": 10, "temperature": 0}
    whole = client(gateway).responses.create(**fields)
    kinds: list[str] = []
    deltas: list[str] = []
    with client(gateway).responses.stream(**fields) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.output_item.done",
    ):
        assert kind in kinds, kinds
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.status == whole.status
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_call_round_trip(gateway: Proc) -> None:
    api = client(gateway)
    first = api.responses.create(
        model=MODEL, input=QUESTION, tools=[TOOL], tool_choice="required", temperature=0
    )
    assert first.status == "completed", first
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) >= 1 and all(c.name == "lookup" for c in calls), first.output
    call = calls[0]
    assert json.loads(call.arguments)["word"] in ("yes", "no")
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")

    history: Any = [
        {"role": "user", "content": QUESTION},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "it is"},
    ]
    second = api.responses.create(
        model=MODEL, input=history, tools=[TOOL], max_output_tokens=8, temperature=0
    )
    chat = api.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": QUESTION},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "it is"},
        ],
        tools=[CHAT_TOOL],
        max_tokens=8,
        temperature=0,
    )
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens  # the same prompt
    assert second.output_text == (chat.choices[0].message.content or "")
    counted = httpx.post(
        gateway.url + "/v1/responses/input_tokens",
        json={"model": MODEL, "input": history, "tools": [TOOL]},
        timeout=30,
    )
    assert counted.status_code == 200, counted.text
    assert counted.json() == {
        "object": "response.input_tokens",
        "input_tokens": chat.usage.prompt_tokens,
    }


def test_streamed_function_call_matches_the_whole_one(gateway: Proc) -> None:
    fields: Any = {
        "model": MODEL,
        "input": QUESTION,
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "lookup"},
        "parallel_tool_calls": False,
        "temperature": 0,
    }
    whole = client(gateway).responses.create(**fields)
    arguments: list[str] = []
    with client(gateway).responses.stream(**fields) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments.append(event.delta)
        final = stream.get_final_response()
    [whole_call] = [item for item in whole.output if item.type == "function_call"]
    [streamed_call] = [item for item in final.output if item.type == "function_call"]
    assert "".join(arguments) == streamed_call.arguments == whole_call.arguments
    assert streamed_call.name == whole_call.name == "lookup"
    assert final.status == whole.status == "completed"


def test_json_schema_text_format(gateway: Proc) -> None:
    response = client(gateway).responses.create(
        model=MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "answer", "schema": LOOKUP_PARAMETERS}},
        temperature=0,
    )
    assert response.status == "completed", response
    assert json.loads(response.output_text)["word"] in ("yes", "no")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0]"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
    ],
)
def test_what_a_stateless_gateway_cannot_take_is_a_400(
    gateway: Proc, fields: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": QUESTION, **fields}
    answer = httpx.post(gateway.url + "/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_agents_sdk_runs_a_function_tool(gateway: Proc) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def lookup(word: Literal["yes", "no"]) -> str:  # an enum: the grammar writes it whole
        """Look a word up."""
        asked.append(word)
        return f"{word} is a word"

    model = OpenAIResponsesModel(
        model=MODEL,
        openai_client=openai.AsyncOpenAI(
            base_url=gateway.url + "/v1", api_key="unused", max_retries=0
        ),
    )
    agent = Agent(
        name="looker",
        instructions="Look words up.",
        tools=[lookup],
        model=model,
        # The first turn must call the tool; the SDK then resets tool_choice to auto.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=96),
    )
    result = Runner.run_sync(agent, QUESTION, max_turns=4)
    assert asked and asked[0] in ("yes", "no"), result.new_items
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert isinstance(result.final_output, str)


AGENTS_DOC = Path(__file__).parents[2] / "docs" / "agents.md"
RECIPE_MARK = "<!-- agents-recipe:"


def recipe() -> str:
    """The Python block that follows the recipe's marker in docs/agents.md, as written."""
    text = AGENTS_DOC.read_text()
    after = text[text.index(RECIPE_MARK) :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```\n", start)]


@pytest.fixture(scope="module")
def roomy_gateway(long_model_path: Path) -> Iterator[Proc]:
    """The tiny model with room for a string argument of the grammar's longest: the random
    model writes byte tokens, up to four to a character, where a real model writes whole ones."""
    with (
        start_worker(long_model_path, slots=1, ctx_size=6144) as worker,
        start_gateway(long_model_path, worker.endpoint, served_model_name=MODEL) as gateway,
    ):
        yield gateway


def test_the_documented_agents_recipe_runs_on_a_base_model(roomy_gateway: Proc) -> None:
    """docs/agents.md's recipe for the Agents SDK, run as written against a gateway (only its
    URL and model name swapped): a random model, so a base model of the worst kind."""
    from agents import Runner

    gateway = roomy_gateway

    code = recipe()
    for line in ('BASE_URL = "http://127.0.0.1:8000/v1"', 'MODEL = "gemma-3-270m-q4_k_m"'):
        assert line in code
    code = code.replace("http://127.0.0.1:8000/v1", gateway.url + "/v1")
    code = code.replace("gemma-3-270m-q4_k_m", MODEL)
    scope: dict[str, Any] = {}
    exec(compile(code, str(AGENTS_DOC), "exec"), scope)  # our own docs
    result = scope["result"]
    assert len(result.raw_responses) == 1  # one model turn: the call
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"], kinds
    call = result.new_items[0].raw_item
    city = json.loads(call.arguments)["city"]
    assert result.final_output == f"sunny in {city}"

    async def streamed() -> Any:
        run = Runner.run_streamed(scope["agent"], "What is the weather in Rome?")
        async for _ in run.stream_events():
            pass
        return run

    run = asyncio.run(streamed())
    assert [item.type for item in run.new_items] == kinds
    assert isinstance(run.final_output, str) and run.final_output.startswith("sunny in ")
