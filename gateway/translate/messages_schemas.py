"""Request bodies of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens).

Content blocks are declared loosely (JSON objects with a `type`): messages.py checks and
translates them, with a 400 naming what it cannot take.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..api.fields import INT32_MAX, JsonInt, RequestModel


class AnthropicMessage(RequestModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]] = Field(
        description="Text, or blocks: text, tool_use (assistant), tool_result (user)."
    )


class AnthropicTool(RequestModel):
    """A client tool: its name, description and input's JSON schema."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="A JSON schema.")
    type: Literal["custom"] | None = None
    cache_control: Any = None


class AnthropicToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, description="The tool, for type `tool`.")
    disable_parallel_tool_use: bool | None = None


def thinking_schema(schema: dict[str, Any]) -> None:
    """Anthropic's `thinking`, as messages.thinking_kwargs takes it (the rest is a 400)."""
    schema.clear()
    schema["anyOf"] = [
        {
            "type": "object",
            "properties": {
                "type": {"const": "enabled"},
                "budget_tokens": {"type": "integer", "minimum": 1},
            },
            "required": ["type", "budget_tokens"],
        },
        {"type": "object", "properties": {"type": {"const": "disabled"}}, "required": ["type"]},
        {"type": "null"},
    ]


class CountTokensRequest(RequestModel):
    """POST /v1/messages/count_tokens."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = Field(
        default=None, description="Text, or text blocks."
    )
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Any = Field(
        default=None,
        json_schema_extra=thinking_schema,
        description="{type: enabled, budget_tokens} or {type: disabled}: the chat template's "
        "enable_thinking and thinking switches; enabled, the answer has thinking blocks.",
    )


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: JsonInt = Field(ge=1, le=INT32_MAX, description="Required, as Anthropic has it.")
    stop_sequences: list[str] | None = None
    # The chat request's bounds (api/schemas.py): the body becomes one.
    temperature: float | None = Field(
        default=None, json_schema_extra={"minimum": 0, "maximum": 100}
    )
    top_p: float | None = Field(
        default=None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1}
    )
    top_k: JsonInt | None = Field(default=None, ge=0, le=INT32_MAX)
    grammar: str | None = Field(
        default=None,
        description="A GBNF grammar with a root rule: the output is held to it, as on "
        "/v1/chat/completions (llama.cpp's extension).",
    )
    stream: bool | None = False
    metadata: dict[str, Any] | None = Field(
        default=None, description="`user_id` shares the server as OpenAI's `user` does."
    )
    service_tier: str | None = None
