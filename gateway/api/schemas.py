"""Request bodies of the HTTP API, as OpenAI (and llama-server for extras) has them.

Fields OpenAI does not define are ignored, as vLLM and llama-server do; every field OpenAI
defines is declared, so that one we cannot honour gets a 400 naming it (params.py).
Their JSON types are strict, and integral floats are integers (fields.py); the bodies the
gateway answers with are in response_bodies.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WrapValidator

from ...protocol.limits import MAX_LOGIT_BIAS
from ...protocol.messages import MAX_EMBED_INPUTS
from .fields import (
    FAIL_FAST,
    INT32_MAX,
    JsonInt,
    RequestModel,
    TokenIds,
    ids_from_zero_schema,
    integral_ids,
    only_null_schema,
    schema_range,
    token_ids_schema,
)

MAX_TOOLS = 128  # OpenAI's limit on `tools` (request/limits.py checks it before validation)
# Messages in one chat (or input items of a Responses request): far more than any context
# holds turns of, and few enough to check each of them in a millisecond.
MAX_MESSAGES = 4096


class StreamOptions(RequestModel):
    include_usage: bool = False
    # OpenAI pads its chunks; ours need no padding, and asking for it is a 400.
    include_obfuscation: bool | None = Field(
        default=None, json_schema_extra={"enum": [False, None]}
    )


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """text, json_object, or json_schema; llama-server also takes json_object with a schema."""

    # json_schema needs its schema (text/grammar.py): the served schema says so too.
    model_config = ConfigDict(
        strict=True,
        json_schema_extra={
            "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
            "then": {
                "required": ["json_schema"],
                "properties": {
                    "json_schema": {
                        "type": "object",
                        "required": ["schema"],
                        "properties": {"schema": {"type": "object"}},
                    }
                },
            },
        },
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class GenerationFields(RequestModel):
    """The sampling fields both endpoints share. None everywhere means "the default"."""

    model: str | None = Field(default=None, description="The served model; optional.")
    temperature: float | None = Field(
        default=None, description="0 is greedy. Default 1.", json_schema_extra=schema_range(0, 100)
    )
    top_p: float | None = Field(
        default=None,
        description="Nucleus sampling. Default 1.",
        json_schema_extra={"exclusiveMinimum": 0, "maximum": 1},
    )
    n: JsonInt | None = Field(
        default=None,
        description="Choices per prompt (at most 128 choices, prompts x n, in all).",
        json_schema_extra={"minimum": 1},
    )
    stop: str | list[str] | None = Field(
        default=None,
        description="Up to 4 stop strings of at most 512 characters.",
        json_schema_extra={
            "anyOf": [
                {"type": "string", "maxLength": 512},
                {"type": "array", "items": {"type": "string", "maxLength": 512}, "maxItems": 4},
                {"type": "null"},
            ]
        },
    )
    seed: JsonInt | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(
        default=None,
        description="Token id (as a string) to a bias in [-100, 100].",
        json_schema_extra={
            "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
    )
    presence_penalty: float | None = Field(default=None, json_schema_extra=schema_range(-2, 2))
    frequency_penalty: float | None = Field(default=None, json_schema_extra=schema_range(-2, 2))
    response_format: ResponseFormat | None = None
    user: str | None = Field(
        default=None, description="The end user; requests without an API key share by it."
    )
    priority: JsonInt | None = Field(
        default=None,
        description="Lower is served first under --scheduling-policy priority (as vLLM). "
        "Default 0. Clamped into the range the API key may claim (--api-key-file).",
        json_schema_extra=schema_range(-(2**31) + 1, 2**31 - 1),
    )
    logprobs: bool | JsonInt | None = Field(
        default=None,
        description="Completions: alternatives per token (0-20). Chat: true for logprobs.",
    )
    top_logprobs: JsonInt | None = Field(
        default=None,
        description="Chat: alternatives (0-20).",
        json_schema_extra=schema_range(0, 20),
    )
    # llama.cpp's extras
    top_k: JsonInt | None = Field(
        default=None, ge=0, le=INT32_MAX, description="0 disables. Default 0."
    )
    min_p: float | None = Field(
        default=None, description="Default 0.", json_schema_extra=schema_range(0, 1)
    )
    repeat_penalty: float | None = Field(
        default=None,
        description="Default 1 (off).",
        json_schema_extra={"exclusiveMinimum": 0, "maximum": 10},
    )
    repeat_last_n: JsonInt | None = Field(
        default=None, ge=-1, le=INT32_MAX, description="-1: the whole context. Default 64."
    )
    grammar: str | None = Field(default=None, description="A GBNF grammar with a root rule.")
    ignore_eos: bool | None = False
    speculative: bool | None = Field(
        default=None,
        description="false: the worker drafts no tokens for this request (n-gram "
        "speculation; the output is the same). Default true.",
    )


class CompletionRequest(GenerationFields):
    """POST /v1/completions."""

    # Left to right, token ids early: pydantic's "smart" union tried every member on a
    # million ids and took seconds of the event loop.
    prompt: Annotated[
        str | TokenIds | Annotated[list[str], FAIL_FAST] | Annotated[list[TokenIds], FAIL_FAST],
        WrapValidator(integral_ids),
    ] = Field(
        description="A string, a list of one string, or token ids.",
        union_mode="left_to_right",
        json_schema_extra=token_ids_schema,
    )
    max_tokens: JsonInt | None = Field(
        default=None,
        le=INT32_MAX,
        description="Default 16, as OpenAI and vLLM (capped by the slot's context); "
        "more than the context leaves after the prompt is a 400.",
        json_schema_extra={"minimum": 1},
    )
    echo: bool | None = Field(default=None, description="Prepend the prompt to the text.")
    best_of: JsonInt | None = Field(
        default=None,
        description="Only 1 is supported (or a value equal to n).",
        json_schema_extra={"minimum": 1, "maximum": 1},
    )
    top_logprobs: JsonInt | None = Field(
        default=None,
        description="Chat's; completions take logprobs.",
        json_schema_extra=only_null_schema,
    )
    suffix: str | None = Field(
        default=None, description="Not supported.", json_schema_extra={"maxLength": 0}
    )


class TextPart(RequestModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON text.")


class ToolCall(BaseModel):
    """A call the assistant made: in a response, and in the history a request sends back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, description="Assistant messages.")
    tool_call_id: str | None = Field(default=None, description="Tool messages: the call answered.")
    reasoning_content: str | None = Field(
        default=None,
        description="Assistant messages: their thinking, for templates that render it (as "
        "reasoning_content, and as gpt-oss's thinking); `reasoning` is the same.",
    )
    reasoning: str | None = None


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="A JSON schema.")
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationFields):
    """POST /v1/chat/completions."""

    # top_logprobs asks for alternatives of the logprobs that `logprobs` turns on: without
    # it, a 400 (params.py), as OpenAI answers; the schema says so.
    model_config = ConfigDict(
        strict=True,
        json_schema_extra={
            "dependentSchemas": {
                "top_logprobs": {
                    "anyOf": [
                        {"properties": {"top_logprobs": {"type": "null"}}},
                        {
                            "required": ["logprobs"],
                            "properties": {"logprobs": {"not": {"enum": [False, 0, None]}}},
                        },
                    ]
                }
            }
        },
    )

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: JsonInt | None = Field(
        default=None,
        le=INT32_MAX,
        description="Deprecated by OpenAI; see below.",
        json_schema_extra={"minimum": 1},
    )
    max_completion_tokens: JsonInt | None = Field(
        default=None,
        le=INT32_MAX,
        description="Default: the rest of the slot's context, as vLLM; more is a 400.",
        json_schema_extra={"minimum": 1},
    )
    tools: list[ToolDefinition] | None = Field(
        default=None, max_length=MAX_TOOLS, description="Functions to call."
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="Default: auto with tools, none without."
    )
    parallel_tool_calls: bool | None = Field(default=None, description="Default true.")
    # OpenAI's, declared to be refused with a 400 unless they ask for nothing (params.py).
    audio: Any = Field(default=None, json_schema_extra={"type": "null"})
    modalities: list[str] | None = Field(
        default=None, json_schema_extra={"items": {"enum": ["text"]}, "minItems": 1, "maxItems": 1}
    )
    prediction: Any = None
    reasoning_effort: str | None = Field(
        default=None,
        description="none, minimal, low, medium or high: sets the chat template's "
        "enable_thinking, thinking and reasoning_effort variables.",
    )
    verbosity: str | None = None
    web_search_options: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, description="Accepted, not stored.")
    service_tier: str | None = None
    prompt_cache_key: str | None = Field(
        default=None, description="Accepted, unused: prefix caching is automatic."
    )
    safety_identifier: str | None = Field(default=None, description="Accepted, unused.")
    # llama-server's and vLLM's extras for reasoning models
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="Variables for the chat template (enable_thinking, thinking, ...), over "
        "the server's --chat-template-kwargs.",
    )
    reasoning_format: str | None = Field(
        default=None,
        description="none: the think block stays in content, raw. Default: split into "
        "reasoning_content (auto, deepseek, deepseek-legacy and parsed do the same).",
    )
    # vLLM's and llama-server's names for a thinking budget (request/thinking.py).
    thinking_token_budget: JsonInt | None = Field(
        default=None,
        description="Tokens the reply may think before the worker closes its think block with "
        "the model's end marker (counted in max_tokens). Default: --reasoning-budget.",
    )
    reasoning_budget: JsonInt | None = Field(
        default=None, description="The same as thinking_token_budget (llama-server's name)."
    )


class TokenizeRequest(RequestModel):
    """llama-server's /tokenize."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False
    model: str | None = None  # which model's vocabulary, when the server has several


class DetokenizeRequest(RequestModel):
    """llama-server's /detokenize."""

    tokens: Annotated[TokenIds, WrapValidator(integral_ids)] = Field(
        json_schema_extra=ids_from_zero_schema
    )
    model: str | None = None


class ModelAction(RequestModel):
    """POST /models/load and /models/unload, as llama-server's router mode."""

    model: str = Field(json_schema_extra={"minLength": 1})


def embedding_input_schema(schema: dict[str, Any]) -> None:
    """What embeddings take (http/embeddings.py refuses the rest with a 400): no text and no
    list empty, at most MAX_EMBED_INPUTS inputs, token ids from 0."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    text = {"type": "string", "minLength": 1}
    many = {"minItems": 1, "maxItems": MAX_EMBED_INPUTS}
    schema.pop("anyOf", None)
    schema["anyOf"] = [
        text,
        {"type": "array", "items": text, **many},
        ids,
        {"type": "array", "items": ids, **many},
    ]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings."""

    input: (
        str | Annotated[list[str], FAIL_FAST] | TokenIds | Annotated[list[TokenIds], FAIL_FAST]
    ) = Field(
        description="A text, texts, token ids, or lists of token ids; none empty.",
        json_schema_extra=embedding_input_schema,
    )
    model: str | None = None
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="base64: little-endian float32, as OpenAI sends them."
    )
    dimensions: int | None = Field(
        default=None, description="Not supported.", json_schema_extra=only_null_schema
    )
    user: str | None = None
