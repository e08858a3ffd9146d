"""A chat request's tools, checked: the call syntax, the choice, the grammar that forces it.

tool_choice `auto` (the default with tools) lets the model answer or call; its output is parsed
for calls in the template's syntax. `required` and a named function add a grammar, so the
model can only write a call (of that function) whose arguments match the function's schema;
a named function is called exactly once, whatever parallel_tool_calls says.
`none` renders no tools and parses nothing.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Literal

from ..api.errors import invalid_request
from ..api.schemas import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from ..text.grammar import grammar_error
from ..text.tokenizer import Pieces, Vocab
from .format import ToolFormat
from .framed import ToolParser, tool_parser
from .grammar import ToolGrammarError, tool_grammar
from .template import TemplateTools, system_with_tools

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What one chat request asked of tools."""

    format: ToolFormat
    definitions: list[dict[str, Any]]  # the tools as sent, for the chat template
    choice: Literal["auto", "required", "named"]
    parallel: bool  # parallel_tool_calls: more than one call per reply
    grammar: str | None  # forces a call, for `required` and a named function
    # The system message that shows the tools to a model whose template cannot: the request's
    # own system text, then the tools' prompt ("" when the template shows tools itself).
    injected_prompt: str = ""

    def parser(self) -> ToolParser:
        """A fresh parser for one reply."""
        schemas = {d["function"]["name"]: d["function"].get("parameters") for d in self.definitions}
        return tool_parser(self.format, self.max_calls, schemas)

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1


def tool_request(
    body: ChatCompletionRequest, template_tools: TemplateTools, vocab: Vocab
) -> ToolRequest | None:
    """The request's tools, or None when it has none or chose `none`; 400 for bad ones."""
    request = _tool_request(body, template_tools.format, vocab)
    if request is not None and not template_tools.renders_tools:
        # The whole system message, as the template renders it: a model that echoes its
        # prompt copies the request's system text first, then ours.
        prompt = system_with_tools(_system_text(body), request.definitions)
        request = dataclasses.replace(request, injected_prompt=prompt)
    return request


def _system_text(body: ChatCompletionRequest) -> str:
    """The text of the request's leading system (or developer) message, "" when none."""
    first = body.messages[0] if body.messages else None
    if first is None or first.role not in ("system", "developer"):
        return ""
    content = first.content
    if isinstance(content, list):
        return "".join(part.text or "" for part in content if part.type == "text")
    return content or ""


def _tool_request(body: ChatCompletionRequest, fmt: ToolFormat, vocab: Vocab) -> ToolRequest | None:
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise invalid_request("tool_choice needs tools", "tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    for name in names:
        if not FUNCTION_NAME.match(name):
            raise invalid_request(
                f"function name {name!r} must be 1 to 64 letters, digits, '_' or '-'", "tools"
            )
    if len(set(names)) != len(names):
        raise invalid_request("function names must be unique", "tools")
    if choice == "none":
        return None
    parallel = body.parallel_tool_calls is not False
    if choice in (None, "auto"):
        return ToolRequest(fmt, _definitions(tools), "auto", parallel, None)

    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise invalid_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                "tool_choice",
            )
        chosen = [t for t in tools if t.function.name == choice.function.name]
        kind: Literal["required", "named"] = "named"
        parallel = False  # a named function is called once, as vLLM calls it
    else:
        chosen, kind = list(tools), "required"
    if body.grammar or (body.response_format is not None and body.response_format.type != "text"):
        raise invalid_request(
            "a required or named tool_choice constrains the output itself; "
            "drop grammar and response_format",
            "tool_choice",
        )
    functions = [(t.function.name, t.function.parameters) for t in chosen]
    try:
        grammar = tool_grammar(fmt, functions, parallel)
    except ToolGrammarError as exc:
        raise invalid_request(str(exc), "tools") from exc
    error = grammar_error(grammar)
    if error:
        raise invalid_request(f"the tools' schemas give no usable grammar: {error}", "tools")
    return ToolRequest(fmt, _definitions(tools), kind, parallel, grammar)


def _definitions(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    """The tools as the chat template reads them; written only for a request that goes on
    (128 tools of 800 properties took 0.1 s)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


class MarkerPieces:
    """A vocabulary's pieces, with the control tokens that spell call markers written out.

    Mistral's [TOOL_CALLS], Llama 3's <|python_tag|>, Harmony's <|call|> and many other
    families' markers are control tokens, which text otherwise leaves out; the parser needs
    to see them, as llama-server keeps them.
    """

    __slots__ = ("_markers", "_vocab")

    def __init__(self, vocab: Vocab, fmt: ToolFormat) -> None:
        self._vocab = vocab
        self._markers: dict[int, bytes] = {}
        for marker in fmt.markers():
            ids = vocab.tokenize(marker, add_special=False, parse_special=True)
            if len(ids) == 1 and not vocab.piece(ids[0]):
                self._markers[ids[0]] = marker.encode()

    def pieces(self) -> Pieces:
        """Itself when some marker is a control token, else the plain vocabulary."""
        return self if self._markers else self._vocab

    @property
    def n_tokens(self) -> int:
        return self._vocab.n_tokens

    def piece(self, token_id: int) -> bytes:
        return self._markers.get(token_id) or self._vocab.piece(token_id)
