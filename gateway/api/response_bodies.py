"""Response bodies of the HTTP API, as OpenAI (and llama-server for extras) shapes them.

What the gateway answers: completions and chat completions (render.py fills them), usage,
logprobs, models, tokenize and detokenize, embeddings, and the error body; and the OpenAPI
note of a route that may stream. The request bodies are in schemas.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from .schemas import ToolCall


def streamed_responses(description: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI for a route that answers JSON, or server-sent events when `stream` is true."""
    # Before OpenAPI 3.2 a text/event-stream schema describes one event (as clients and
    # schemathesis read it): its `data` is a JSON chunk (or [DONE]), its `event` a name.
    events = {
        "type": "object",
        "description": "one server-sent event: a `data: <JSON>` line (`event:` too, for the "
        "Responses and Messages APIs)",
        "properties": {
            "data": {"type": "string"},
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
        "required": ["data"],
    }
    return {200: {"description": description, "content": {"text/event-stream": {"schema": events}}}}


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # of completion_tokens, those of the think block


class Usage(BaseModel):
    """Token counts of a response: the one usage type of the gateway, as OpenAI shapes it."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Only for a reply whose think block was split from its answer (render.py).
    completion_tokens_details: CompletionTokensDetails | None = None

    # No return annotation: pydantic then keeps the model's own schema in the OpenAPI document.
    @model_serializer(mode="wrap")
    def _without_details(self, handler: SerializerFunctionWrapHandler):
        return _drop_none(handler(self), ("completion_tokens_details",))

    def with_reasoning(self, reasoning_tokens: int) -> Usage:
        """The same counts, with the reasoning part of completion_tokens."""
        details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        return self.model_copy(update={"completion_tokens_details": details})

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        """Usage from the three counts the worker reports; the total follows from them."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class CompletionLogprobs(BaseModel):
    """Completions' logprobs, one entry per generated token in each list; with echo, the
    prompt's tokens first (its first token's logprob and top are null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat's logprobs: one entry per generated token of the content."""

    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # The think block of a reasoning model's reply, under both names clients read
    # (llama-server's and DeepSeek's reasoning_content, vLLM's reasoning); left out otherwise.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")  # no return annotation: as Usage's
    def _without_reasoning(self, handler: SerializerFunctionWrapHandler):
        return _drop_none(handler(self), ("reasoning_content", "reasoning"))


def _drop_none(fields: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The fields without those of `names` that are None (extras that most answers lack)."""
    return {k: v for k, v in fields.items() if not (k in names and v is None)}


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None  # the same while loomserve's version and model are
    choices: list[ChatChoice]
    usage: Usage


class ModelStatus(BaseModel):
    """Where a model is, as llama-server's router mode says: loaded, loading, unloading,
    unloaded (loads on demand) or unavailable (no worker serves it, none can be started)."""

    value: str


class UnavailableModelStatus(ModelStatus):
    """An unavailable model's status with why: its worker is lost, refused, or not ready."""

    reason: str


class FailedModelStatus(UnavailableModelStatus):
    """A model whose file cannot be loaded, as llama-server's router marks a failed load."""

    failed: Literal[True] = True


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loomserve"
    max_model_len: int | None = None
    status: FailedModelStatus | UnavailableModelStatus | ModelStatus | None = None
    input_modalities: list[Literal["text", "image"]] | None = Field(
        default=None,
        description="What its prompts may hold: text, and image for a vision model (a "
        "worker with --mmproj); null while no worker of it is connected.",
    )


class ModelActionResult(BaseModel):
    success: bool = True
    model: str
    status: ModelStatus


class ModelUnloadResult(ModelActionResult):
    """POST /models/unload's answer: also what happens to the model's requests meanwhile."""

    message: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenPiece(BaseModel):
    id: int
    piece: str


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[TokenPiece]


class DetokenizeResponse(BaseModel):
    content: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
