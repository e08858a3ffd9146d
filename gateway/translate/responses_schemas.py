"""Request bodies of OpenAI's Responses API (/v1/responses, /v1/responses/input_tokens).

Declared loosely where OpenAI's items are many: an input item is a JSON object that
responses.py checks and translates, with a 400 naming what it cannot take.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..api.fields import INT32_MAX, JsonInt, RequestModel, only_null_schema


class ResponsesFunctionTool(RequestModel):
    """A function tool, as the Responses API writes it (flat, not under `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="A JSON schema.")
    strict: bool | None = None


class ResponsesNamedTool(RequestModel):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(RequestModel):
    """text.format: text, json_object, or json_schema with its schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(RequestModel):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesInputTokensRequest(RequestModel):
    """POST /v1/responses/input_tokens: what the prompt of such a request would count."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(
        description="A user message, or a list of items: messages (`role`, `content`), "
        "`function_call` and `function_call_output`."
    )
    instructions: str | None = Field(default=None, description="A system message, first.")
    tools: list[ResponsesFunctionTool] | None = Field(
        default=None, description="Function tools only."
    )
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    previous_response_id: str | None = Field(
        default=None, description="Not supported (400): gateways keep no state."
    )
    conversation: Any = Field(
        default=None,
        description="Not supported: only null (gateways keep no state).",
        json_schema_extra=only_null_schema,
    )
    reasoning: Any = None
    truncation: Literal["auto", "disabled"] | None = None


class ResponsesRequest(ResponsesInputTokensRequest):
    """POST /v1/responses."""

    max_output_tokens: JsonInt | None = Field(
        default=None, ge=1, le=INT32_MAX, description="Default: the rest of the context."
    )
    # The chat request's bounds (api/schemas.py): the body becomes one.
    temperature: float | None = Field(
        default=None, json_schema_extra={"minimum": 0, "maximum": 100}
    )
    top_p: float | None = Field(
        default=None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1}
    )
    stream: bool | None = False
    store: bool | None = Field(
        default=None,
        description="Only false (or absent): gateways store no response.",
        json_schema_extra={"enum": [False, None]},
    )
    background: bool | None = Field(
        default=None,
        description="Only false (or absent).",
        json_schema_extra={"enum": [False, None]},
    )
    include: list[str] | None = None
    metadata: dict[str, str] | None = Field(default=None, description="Echoed, not stored.")
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    top_logprobs: JsonInt | None = None
    max_tool_calls: JsonInt | None = None
    grammar: str | None = Field(
        default=None,
        description="A GBNF grammar with a root rule: the output is held to it, as on "
        "/v1/chat/completions (llama.cpp's extension).",
    )
    stream_options: dict[str, Any] | None = None
