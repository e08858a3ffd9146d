"""GenerationRequest: one HTTP generation request, checked, on its way to the worker and back.

The route builds it from the body (app.py), GenerationGroup runs each of its choices as a
sequence in the worker and assembles their text, render.py shapes the response from it.
Which API it came to is the body's type.

A request has one or more prompts (completions take a list) and `n` choices per prompt.
Choices are numbered as OpenAI numbers them, prompt-major: choice `p * n + j` is the j-th
sample of prompt p.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...protocol.messages import DEFAULT_TENANT, Generate, SamplingParams
from ..api.schemas import ChatCompletionRequest, CompletionRequest
from ..text.reasoning import ReasoningFamily, ReasoningSplitter, ReplySplit
from ..text.stop import StopMatcher, TextMatcher
from ..tools.checks import ToolRequest
from ..tools.end import PromptEcho, ToolCallEnd
from ..tools.framed import ToolParser

ApiBody = CompletionRequest | ChatCompletionRequest


@dataclass(slots=True)
class Prompt:
    """One prompt of a request, tokenized, with what the worker needs to run it."""

    tokens: list[int]  # after the chat template for chat
    params: SamplingParams  # max_tokens already capped by what the slot's context leaves
    text: str = ""  # the prompt as text, for completions' echo
    # A chat's images (request/images.py): their files, and where each goes in `tokens`.
    images: list[bytes] = dataclasses.field(default_factory=list)
    image_at: list[int] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ReplyReasoning:
    """How a chat reply's think block is split from its answer (text/reasoning.py)."""

    family: ReasoningFamily
    inside: bool  # the prompt opened the block: the reply starts in it


@dataclass(slots=True)
class GenerationRequest:
    """Everything the gateway decided about a request before it reaches the worker."""

    id: str  # the response's id ("cmpl-..." or "chatcmpl-..."); the worker's ids derive from it
    body: ApiBody  # the request as sent: its type says which API, its fields what was asked
    prompts: list[Prompt]
    n: int  # choices per prompt
    stops: tuple[str, ...]  # stop strings, matched by the gateway on the text
    model: str  # the served model name the response reports
    arrived_at: float  # time.monotonic() when the route took the request
    created: int  # unix seconds, the response's `created`
    tools: ToolRequest | None = None  # chat with tools: its output is parsed for calls
    # Completions' echo with max_tokens 0: the answer is the prompt (scored, with logprobs);
    # the worker generates one token all the same, which the gateway drops.
    score_only: bool = False
    priority: int = 0  # lower is served first when the worker schedules by priority
    tenant: str = DEFAULT_TENANT  # the API key's name, else the body's `user`
    reasoning: ReplyReasoning | None = None  # chat whose think block is split from the answer

    def tool_parser(self) -> ToolParser | None:
        """A parser for the reply's tool calls, when the request has tools."""
        return self.tools.parser() if self.tools is not None else None

    def text_matcher(self) -> TextMatcher:
        """What ends a choice on its raw text: the stop strings, and with tools its calls'
        end (with reasoning, reply_split's: the calls' end reads the answer only)."""
        stops = StopMatcher(self.stops)
        tools = self.tools
        if tools is None:
            return stops
        ending: TextMatcher = stops if self.reasoning else ToolCallEnd(stops, tools.parser())
        if tools.injected_prompt and tools.choice == "auto":
            return PromptEcho(ending, tools.injected_prompt)
        return ending

    def reply_split(self) -> ReplySplit | None:
        """A choice's one split of its thinking from its answer, when the reply has one."""
        reasoning = self.reasoning
        if reasoning is None:
            return None
        tools = self.tools
        answer_end = ToolCallEnd(StopMatcher(()), tools.parser()) if tools is not None else None
        return ReplySplit(ReasoningSplitter(reasoning.family, reasoning.inside), answer_end)

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

    @property
    def echo(self) -> bool:
        """Whether each completion choice starts with its prompt (completions' echo)."""
        return isinstance(self.body, CompletionRequest) and bool(self.body.echo)

    @property
    def logprobs(self) -> bool:
        """Whether the response carries the generated tokens' logprobs."""
        return self.prompts[0].params.logprobs is not None

    @property
    def n_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> Prompt:
        """The prompt choice `index` continues."""
        return self.prompts[index // self.n]

    def worker_id(self, index: int) -> str:
        """The worker's request id of a choice: the response's id, suffixed when it has many."""
        return self.id if self.n_choices == 1 else f"{self.id}-{index}"

    def to_worker(self, index: int = 0) -> Generate:
        """The protocol message that runs choice `index` in the worker."""
        prompt = self.prompt_of(index)
        params, sample = prompt.params, index % self.n
        if sample and params.seed is not None:
            # The n samples of one seeded prompt differ from each other, and reproducibly.
            params = dataclasses.replace(params, seed=(params.seed + sample) % 2**32)
        return Generate(
            self.worker_id(index),
            prompt.tokens,
            params,
            self.priority,
            self.tenant,
            images=prompt.images,
            image_at=prompt.image_at,
        )
