"""Reasoning models end to end on the tiny model: served with Qwen3's chat template (the
think block split from the answer at `<think>`/`</think>`), its output forced by a grammar to
a fixture's exact text, through /v1/chat/completions (whole and streamed); with Qwen3.5's
template, which opens the block in the prompt, through /v1/responses and /v1/messages; and
the thinking controls (chat_template_kwargs, reasoning_effort, Anthropic's thinking) reach
the template, which the prompt's token count shows."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import Proc, start_gateway, start_worker

TEMPLATES = Path(__file__).resolve().parent.parent / "data" / "templates"
QWEN3 = TEMPLATES / "Qwen-Qwen3-0.6B.jinja"
QWEN35 = TEMPLATES / "Qwen3.5-4B.jinja"
OUTPUT = "<think>\nabc, then def\n</think>\n\nThe answer."
GRAMMAR = f"root ::= {json.dumps(OUTPUT)}"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def gateways(tiny_model_path: Path) -> Iterator[tuple[Proc, Proc]]:
    """A worker, a gateway with Qwen3's template, one with Qwen3.5's."""
    with (
        start_worker(tiny_model_path, slots=2, ctx_size=2048) as worker,
        start_gateway(tiny_model_path, worker.endpoint, chat_template=QWEN3) as qwen3,
        start_gateway(tiny_model_path, worker.endpoint, chat_template=QWEN35) as qwen35,
    ):
        yield qwen3, qwen35


def post(gateway: Proc, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(gateway.url + path, json=body, timeout=30)


def events(gateway: Proc, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON payloads of a streamed answer, in order."""
    payloads = []
    with httpx.stream("POST", gateway.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payloads.append(json.loads(line.removeprefix("data: ")))
    return payloads


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 64, "temperature": 0, **fields}


def think_tokens(logprobs: dict[str, Any]) -> int:
    """The generated tokens up to the one that completes `</think>` (as the model tokenized
    its forced text, which logprobs show token by token)."""
    text = ""
    for count, entry in enumerate(logprobs["content"], 1):
        text += entry["token"]
        if "</think>" in text:
            return count
    raise AssertionError(f"no end of the think block in {text!r}")


def test_a_whole_answer_splits_reasoning_from_content(gateways: tuple[Proc, Proc]) -> None:
    body = chat_body(grammar=GRAMMAR, logprobs=True)
    reply = post(gateways[0], "/v1/chat/completions", body).json()
    message = reply["choices"][0]["message"]
    assert message["content"] == "The answer."
    assert message["reasoning_content"] == message["reasoning"] == "abc, then def"
    usage = reply["usage"]
    reasoning_tokens = usage["completion_tokens_details"]["reasoning_tokens"]
    # Exactly the tokens of the think block, its markers included.
    assert reasoning_tokens == think_tokens(reply["choices"][0]["logprobs"])
    assert reasoning_tokens < usage["completion_tokens"]


def test_a_stream_splits_reasoning_from_content(gateways: tuple[Proc, Proc]) -> None:
    body = chat_body(grammar=GRAMMAR, stream=True, stream_options={"include_usage": True})
    payloads = events(gateways[0], "/v1/chat/completions", body)
    deltas = [p["choices"][0]["delta"] for p in payloads if p["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    assert reasoning == "".join(d.get("reasoning") or "" for d in deltas) == "abc, then def"
    assert "".join(d.get("content") or "" for d in deltas) == "The answer."
    usage = payloads[-1]["usage"]
    whole = post(gateways[0], "/v1/chat/completions", chat_body(grammar=GRAMMAR, logprobs=True))
    expected = think_tokens(whole.json()["choices"][0]["logprobs"])
    assert usage["completion_tokens_details"]["reasoning_tokens"] == expected


def test_reasoning_format_none_keeps_the_raw_text(gateways: tuple[Proc, Proc]) -> None:
    body = chat_body(grammar=GRAMMAR, reasoning_format="none")
    message = post(gateways[0], "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] == OUTPUT
    assert "reasoning_content" not in message


def test_a_reply_cut_inside_the_block_is_reasoning_only(gateways: tuple[Proc, Proc]) -> None:
    # The tokens the model writes the forced text in (the grammar, not /tokenize, decides
    # them) up to past "<think>\nabc": the reply is cut there, inside the block.
    whole = post(gateways[0], "/v1/chat/completions", chat_body(grammar=GRAMMAR, logprobs=True))
    written, n_tokens = "", 0
    for entry in whole.json()["choices"][0]["logprobs"]["content"]:
        written, n_tokens = written + entry["token"], n_tokens + 1
        if len(written) >= len("<think>\nabc"):
            break
    body = chat_body(grammar=GRAMMAR, max_tokens=n_tokens)
    reply = post(gateways[0], "/v1/chat/completions", body).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"] == written.removeprefix("<think>").strip()
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == n_tokens


def prompt_tokens(gateway: Proc, **fields: Any) -> int:
    body = chat_body(max_tokens=1, **fields)
    response = post(gateway, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens"]


def test_chat_template_kwargs_reach_the_template(gateways: tuple[Proc, Proc]) -> None:
    qwen3 = gateways[0]
    thinking = prompt_tokens(qwen3)
    # Qwen3 with enable_thinking false closes an empty think block in the prompt.
    off = prompt_tokens(qwen3, chat_template_kwargs={"enable_thinking": False})
    assert off > thinking
    assert prompt_tokens(qwen3, reasoning_effort="none") == off
    assert prompt_tokens(qwen3, reasoning_effort="high") == thinking


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chat_template_kwargs", ["enable_thinking"]),
        ("reasoning_effort", "extreme"),
        ("reasoning_format", "markdown"),
        ("thinking_token_budget", 0),
        ("reasoning_budget", -1),
    ],
)
def test_bad_thinking_controls_are_a_400_naming_the_field(
    gateways: tuple[Proc, Proc], field: str, value: Any
) -> None:
    response = post(gateways[0], "/v1/chat/completions", chat_body(**{field: value}))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


# --- /v1/responses and /v1/messages ----------------------------------------------------
# Qwen3.5's template opens the think block in the prompt: the tiny model's whole reply, cut
# at max_tokens, is reasoning.

THINK_TOKENS = 8


def chat_reasoning(gateway: Proc, **fields: Any) -> str:
    body = chat_body(max_tokens=THINK_TOKENS, **fields)
    message = post(gateway, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] == "" and message["reasoning_content"]
    return message["reasoning_content"]


def responses_body(**fields: Any) -> dict[str, Any]:
    return {
        "input": "Say something.",
        "max_output_tokens": THINK_TOKENS,
        "temperature": 0,
        **fields,
    }


def test_responses_carry_a_reasoning_item(gateways: tuple[Proc, Proc]) -> None:
    qwen35 = gateways[1]
    thought = chat_reasoning(qwen35)
    whole = post(qwen35, "/v1/responses", responses_body()).json()
    (item,) = whole["output"]
    assert item["type"] == "reasoning" and item["summary"] == []
    assert item["content"] == [{"type": "reasoning_text", "text": thought}]
    # Cut by max_output_tokens inside the block the prompt opened: every token is thinking.
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == THINK_TOKENS
    streamed = events(qwen35, "/v1/responses", responses_body(stream=True))
    kinds = [e["type"] for e in streamed]
    deltas = "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta")
    assert deltas == thought
    done = next(e for e in streamed if e["type"] == "response.reasoning_text.done")
    assert done["text"] == thought
    assert kinds.index("response.output_item.added") < kinds.index("response.reasoning_text.delta")
    final = streamed[-1]["response"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": thought}]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == THINK_TOKENS
    # reasoning.effort "none" turns thinking off: the answer is a message.
    off = post(qwen35, "/v1/responses", responses_body(reasoning={"effort": "none"})).json()
    assert [i["type"] for i in off["output"]] == ["message"]


def messages_body(**fields: Any) -> dict[str, Any]:
    return {
        "max_tokens": THINK_TOKENS,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Say something."}],
        **fields,
    }


def test_messages_carry_thinking_blocks_when_thinking_is_enabled(
    gateways: tuple[Proc, Proc],
) -> None:
    qwen35 = gateways[1]
    thought = chat_reasoning(qwen35, chat_template_kwargs={"enable_thinking": True})
    enabled = {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    whole = post(qwen35, "/v1/messages", messages_body(**enabled)).json()
    assert whole["content"] == [{"type": "thinking", "thinking": thought, "signature": ""}]
    streamed = events(qwen35, "/v1/messages", messages_body(stream=True, **enabled))
    starts = [e["content_block"] for e in streamed if e["type"] == "content_block_start"]
    assert starts == [{"type": "thinking", "thinking": "", "signature": ""}]
    deltas = [e["delta"] for e in streamed if e["type"] == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == thought
    # Not enabled: no thinking block; disabled: the template closes the block, text comes.
    assert post(qwen35, "/v1/messages", messages_body()).json()["content"] == []
    disabled = post(qwen35, "/v1/messages", messages_body(thinking={"type": "disabled"})).json()
    assert [b["type"] for b in disabled["content"]] == ["text"]
    assert _prompt(disabled["usage"]) > _prompt(whole["usage"])
    bad = post(
        qwen35, "/v1/messages", messages_body(thinking={"type": "enabled", "budget_tokens": 0})
    )
    assert bad.status_code == 400 and "budget_tokens" in bad.json()["error"]["message"]


def _prompt(usage: dict[str, Any]) -> int:
    """The prompt's tokens in Anthropic's usage: those read from the cache and the rest."""
    return usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)


async def _translated(translate: Any, payloads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async def chunks() -> Any:
        for payload in payloads:
            yield payload

    out = []
    async for event in translate(chunks()):
        out.append(json.loads(event.split("data: ", 1)[1]))
    return out


def test_a_split_stream_translates_to_responses_and_messages(gateways: tuple[Proc, Proc]) -> None:
    """The real chat stream of a forced reply (a think block, then the answer), through the
    Responses and Messages translators: reasoning first, then the answer."""
    from loomserve.gateway.translate.messages import MessageEvents, whole_message
    from loomserve.gateway.translate.responses_output import (
        ResponseEvents,
        ResponseHead,
        whole_response,
    )
    from loomserve.gateway.translate.responses_schemas import ResponsesRequest

    qwen3 = gateways[0]
    body = chat_body(grammar=GRAMMAR, stream=True, stream_options={"include_usage": True})
    payloads = events(qwen3, "/v1/chat/completions", body)
    whole_chat = post(qwen3, "/v1/chat/completions", chat_body(grammar=GRAMMAR)).json()
    head = ResponseHead(ResponsesRequest(input="x"), "tiny")
    expected = [
        {"type": "reasoning_text", "text": "abc, then def"},
        {"type": "output_text", "text": "The answer.", "annotations": [], "logprobs": []},
    ]
    whole = whole_response(head, whole_chat)
    assert [i["content"][0] for i in whole["output"]] == expected
    streamed = asyncio.run(_translated(ResponseEvents(head).translate, payloads))
    assert [i["content"][0] for i in streamed[-1]["response"]["output"]] == expected
    message = whole_message("msg_1", "tiny", whole_chat, thinking=True)
    assert message["content"] == [
        {"type": "thinking", "thinking": "abc, then def", "signature": ""},
        {"type": "text", "text": "The answer."},
    ]
    anthropic = asyncio.run(_translated(MessageEvents("msg_1", "tiny", True).translate, payloads))
    deltas = [e["delta"] for e in anthropic if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "abc, then def"
    assert "".join(d.get("text", "") for d in deltas) == "The answer."


def test_the_openai_sdk_reads_the_reasoning(gateways: tuple[Proc, Proc]) -> None:
    """openai's client keeps the fields it does not know in model_extra, whole and streamed."""
    import openai

    client = openai.OpenAI(base_url=gateways[0].url + "/v1", api_key="none")
    fields = {"messages": MESSAGES, "model": "tiny-llama", "max_tokens": 64, "temperature": 0}
    fields = {**fields, "extra_body": {"grammar": GRAMMAR}}
    whole = client.chat.completions.create(**fields)
    message = whole.choices[0].message
    assert message.content == "The answer."
    assert message.model_extra["reasoning_content"] == "abc, then def"
    thought = ""
    for chunk in client.chat.completions.create(**fields, stream=True):
        if chunk.choices:
            thought += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
    assert thought == "abc, then def"


def test_a_json_format_constrains_only_what_follows_the_thinking(
    gateways: tuple[Proc, Proc], tiny_model_path: Path
) -> None:
    """Qwen3.5's prompt opens the block: with a JSON response_format the model still thinks
    freely (the same greedy thinking as without it), where a grammar over the whole reply
    would have made it start with JSON. (Bytes that are no whole character are banned: any
    grammar refuses broken UTF-8, which the tiny model writes.)"""
    from loomserve.gateway.text.tokenizer import Vocab

    vocab = Vocab(tiny_model_path)
    try:
        high = [t for t in range(vocab.n_tokens) if vocab.piece(t) and vocab.piece(t)[0] >= 0x80]
    finally:
        vocab.close()
    ban = {str(token): -100 for token in high}
    qwen35 = gateways[1]
    free = chat_reasoning(qwen35, logit_bias=ban)
    constrained = chat_reasoning(qwen35, logit_bias=ban, response_format={"type": "json_object"})
    assert constrained == free and not free.startswith("{")
    # A request's own grammar is taken as it is: the whole reply, think block included.
    raw = chat_reasoning(qwen35, grammar='root ::= "{" [a-z ]+')
    assert raw.startswith("{")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_read_from_the_answer_only(
    gateways: tuple[Proc, Proc], stream: bool
) -> None:
    """A call written while thinking is thinking; the one after the block is a call."""
    output = f"<think>\nMaybe {CALL}? Yes.\n</think>\n\n{CALL}"
    body = chat_body(tools=TOOLS, grammar=f"root ::= {json.dumps(output)}", max_tokens=200)
    url = "/v1/chat/completions"
    if stream:
        reasoning, names, arguments, finish = "", [], "", None
        for payload in events(gateways[0], url, {**body, "stream": True}):
            for choice in payload["choices"]:
                delta = choice["delta"]
                reasoning += delta.get("reasoning_content") or ""
                for call in delta.get("tool_calls") or []:
                    names += [call["function"]["name"]] if call["function"].get("name") else []
                    arguments += call["function"].get("arguments") or ""
                finish = choice["finish_reason"] or finish
    else:
        choice = post(gateways[0], url, body).json()["choices"][0]
        message, finish = choice["message"], choice["finish_reason"]
        reasoning = message["reasoning_content"]
        names = [c["function"]["name"] for c in message["tool_calls"]]
        arguments = "".join(c["function"]["arguments"] for c in message["tool_calls"])
        assert not message["content"]
    assert reasoning == f"Maybe {CALL}? Yes."
    assert names == ["get_time"] and json.loads(arguments) == {"city": "Paris"}
    assert finish == "tool_calls"


def test_a_forced_call_may_follow_thinking(gateways: tuple[Proc, Proc]) -> None:
    """tool_choice required on Qwen3's template: the call's grammar is wrapped to start after
    an optional think block; the tiny model skips it and calls at once."""
    body = chat_body(tools=TOOLS, tool_choice="required", max_tokens=300)
    response = post(gateways[0], "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
