"""Tools and tool messages through a chat template, as far as the template can render them.

At startup the template is probed (as llama.cpp's minja does): render a tool, a call, a tool
result and a system message, and look for them in the output. What a template cannot render
is written as text it can: the tools as a system prompt in the generic format below, calls as
the model's own call syntax, tool results as user turns, a system message into the first
user turn.

The generic format, for models whose template knows no tools:

    system:    ...the request's system prompt...
               # Tools
               <tools> one JSON object per function, as the request gave it </tools>
               instructions to reply with calls as below
    assistant: <tool_call>
               {"name": "get_weather", "arguments": {"city": "Paris"}}
               </tool_call>
    user:      <tool_response>
               ...the tool message's content...
               </tool_response>
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..text.chat_template import ChatTemplateError, Renderer
from .format import ToolFormat, detect

_PROBE_TOOL = "loomserve_probe_tool"
_PROBE_CALL = "loomserve_probe_call"
_PROBE_RESULT = "loomserve_probe_result"
_PROBE_SYSTEM = "loomserve_probe_system"
_PROBE_CALL_ID = "probe0001"  # nine letters and digits, as Mistral's templates insist

GENERIC_INSTRUCTIONS = """# Tools

You may call one or more functions to help with the user's request. The functions, as JSON:
<tools>
{tools}
</tools>

To call a function, reply with a JSON object holding its name and arguments inside \
<tool_call></tool_call> tags, one call per tag:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}
</tool_call>"""


def generic_tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system prompt text that describes the tools to a model whose template cannot."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return GENERIC_INSTRUCTIONS.format(tools=listed)


def system_with_tools(system: str, tools: list[dict[str, Any]]) -> str:
    """The system message's text once the tools are written into it: the request's own
    system text (if any), then the tools' prompt."""
    text = generic_tools_prompt(tools)
    return f"{system}\n\n{text}" if system else text


@dataclass(frozen=True, slots=True)
class TemplateTools:
    """What one chat template renders of tools, and the call syntax its model writes."""

    format: ToolFormat
    renders_tools: bool  # the `tools` variable shows up in the prompt
    renders_calls: bool  # an assistant message's tool_calls show up
    renders_results: bool  # a `tool` message shows up
    renders_system: bool  # a system message shows up

    @classmethod
    def probe(cls, template: Renderer, parser: str = "auto") -> TemplateTools:
        """Render probes through the template and see what comes out; parser names the call
        syntax (format.py's FAMILIES), or `auto`: the one the template's text shows."""
        tool = {
            "type": "function",
            "function": {
                "name": _PROBE_TOOL,
                "description": "probe",
                # A description on the parameter too: some templates write it unguarded.
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "string", "description": "probe"}},
                },
            },
        }
        user = {"role": "user", "content": "probe"}
        call = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": _PROBE_CALL_ID,
                    "type": "function",
                    "function": {"name": _PROBE_CALL, "arguments": {"x": "probe"}},
                }
            ],
        }
        result = {
            "role": "tool",
            "tool_call_id": _PROBE_CALL_ID,
            "name": _PROBE_CALL,
            "content": _PROBE_RESULT,
        }
        system = {"role": "system", "content": _PROBE_SYSTEM}
        renders_tools = _shows(template, [user], _PROBE_TOOL, tools=[tool])
        return cls(
            format=detect(template.source, renders_tools, parser),
            renders_tools=renders_tools,
            renders_calls=_shows(template, [user, call], _PROBE_CALL),
            renders_results=_shows(template, [user, call, result], _PROBE_RESULT),
            renders_system=_shows(template, [system, user], _PROBE_SYSTEM),
        )

    def prepare(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools to render, with what the template cannot show as text."""
        if tools and not self.renders_tools:
            messages = _with_tools_prompt(messages, tools)
            tools = None
        names = {
            call["id"]: call["function"]["name"]
            for message in messages
            for call in message.get("tool_calls") or ()
        }
        prepared: list[dict[str, Any]] = []
        for message in messages:
            role = message["role"]
            if role == "assistant" and message.get("tool_calls") and not self.renders_calls:
                message = self._calls_as_text(message)
            elif role == "tool":
                message = dict(message)
                name = names.get(message.get("tool_call_id") or "")
                if name and "name" not in message:
                    message["name"] = name
                if not self.renders_results:
                    message = _result_as_user(message)
            previous = prepared[-1] if prepared else None
            if (
                previous is not None
                and previous["role"] == message["role"] == "user"
                and (previous.get("_from_tool") or message.get("_from_tool"))
            ):
                previous["content"] += "\n" + message["content"]
                continue
            prepared.append(message)
        for message in prepared:
            message.pop("_from_tool", None)
        if not self.renders_system:
            prepared = _system_into_first_user(prepared)
        return prepared, tools

    def _calls_as_text(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        text = self.format.write_calls(calls)
        content = message.get("content") or ""
        rest = {k: v for k, v in message.items() if k != "tool_calls"}
        return {**rest, "content": f"{content}\n{text}" if content else text}


def _shows(template: Renderer, messages: list[dict[str, Any]], needle: str, **extra) -> bool:
    try:
        return needle in template.render(messages, add_generation_prompt=False, **extra)
    except ChatTemplateError:
        return False


def _with_tools_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        content = system_with_tools(first.get("content") or "", tools)
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": system_with_tools("", tools)}, *messages]


def _result_as_user(message: dict[str, Any]) -> dict[str, Any]:
    content = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
    return {"role": "user", "content": content, "_from_tool": True}


def _system_into_first_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    if not system:
        return messages
    rest = [dict(m) for m in messages if m["role"] not in ("system", "developer")]
    head = "\n\n".join(system)
    for message in rest:
        if message["role"] == "user":
            message["content"] = f"{head}\n\n{message['content']}"
            return rest
    return [{"role": "user", "content": head}, *rest]
