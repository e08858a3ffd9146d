"""GenerationRequest: one HTTP generation request, checked, on its way to the worker and back.

The route builds it from the body (app.py), Generation sends it to the worker and assembles
its text, render.py shapes the response from it. Which API it came to is the body's type.
"""

from __future__ import annotations

from dataclasses import dataclass

from loomserve.gateway.schemas import ChatCompletionRequest, CompletionRequest
from loomserve.gateway.tool_parser import ToolCallParser
from loomserve.gateway.tools import ToolRequest
from loomserve.protocol.messages import Generate, SamplingParams

ApiBody = CompletionRequest | ChatCompletionRequest


@dataclass(slots=True)
class GenerationRequest:
    """Everything the gateway decided about a request before it reaches the worker."""

    id: str  # the response's id ("cmpl-..." or "chatcmpl-..."); also the worker's request id
    body: ApiBody  # the request as sent: its type says which API, its fields what was asked
    prompt: list[int]  # token ids, after the chat template for chat
    params: SamplingParams  # max_tokens already capped by the slot's context
    stops: tuple[str, ...]  # stop strings, matched by the gateway on the text
    model: str  # the served model name the response reports
    arrived_at: float  # time.monotonic() when the route took the request
    created: int  # unix seconds, the response's `created`
    tools: ToolRequest | None = None  # chat with tools: its output is parsed for calls

    def tool_parser(self) -> ToolCallParser | None:
        """A parser for the reply's tool calls, when the request has tools."""
        return self.tools.parser() if self.tools is not None else None

    @property
    def chat(self) -> bool:
        """Whether it came to /v1/chat/completions (else /v1/completions)."""
        return isinstance(self.body, ChatCompletionRequest)

    @property
    def stream(self) -> bool:
        return bool(self.body.stream)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
        options = self.body.stream_options
        return bool(options and options.include_usage)

    def to_worker(self) -> Generate:
        """The protocol message that runs this request in the worker."""
        return Generate(self.id, self.prompt, self.params)
