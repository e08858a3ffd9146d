"""How a family of models writes tool calls, told from its chat template's text.

The same few facts serve three jobs: the parser finds calls in the output (parser.py),
the grammar forces a call in that syntax (grammar.py), and calls in a conversation's
history are written back as text when the template cannot render them (template.py).
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One tool-call syntax: each call is a JSON object {"name": ..., <arguments_key>: {...}}."""

    name: str
    opens: tuple[str, ...]  # markers that open a run of calls anywhere in the output
    closes: str | None  # the marker that ends a run (None: the JSON itself ends it)
    bare_json: bool  # output that starts with `{` or `[` is a run of calls
    arguments_key: str  # "arguments", or "parameters" (Llama 3)
    parallel: bool  # the syntax holds several calls in one reply
    # Written around calls (history written as text, and the grammar of a forced call):
    call_prefix: str = ""
    call_suffix: str = ""
    list_prefix: str = ""
    list_suffix: str = ""
    separator: str = ""
    id_alphabet_length: int = 0  # ids of exactly this many letters and digits (Mistral); 0: any

    def write_calls(self, calls: list[tuple[str, Any]]) -> str:
        """(name, arguments) pairs as this model would have written them."""
        if not self.parallel:
            calls = calls[:1]
        objects = [
            json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)
            for name, arguments in calls
        ]
        body = self.separator.join(self.call_prefix + o + self.call_suffix for o in objects)
        return self.list_prefix + body + self.list_suffix

    def new_call_id(self) -> str:
        """An id for a call the model made, in the shape its template accepts."""
        if self.id_alphabet_length:
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(self.id_alphabet_length))
        return "call_" + secrets.token_hex(12)


# Hermes 2/3, Qwen 2.5/3 and most fine-tunes: <tool_call>{json}</tool_call>, one per call.
HERMES = ToolFormat(
    name="hermes",
    opens=("<tool_call>",),
    closes="</tool_call>",
    bare_json=False,
    arguments_key="arguments",
    parallel=True,
    call_prefix="<tool_call>\n",
    call_suffix="\n</tool_call>",
    separator="\n",
)
# Models whose template knows no tools: the tools go into the system prompt (template.py)
# and the reply uses Hermes' tags, the syntax most models have seen.
GENERIC = replace(HERMES, name="generic")
# Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], with 9-character call ids.
MISTRAL = ToolFormat(
    name="mistral",
    opens=("[TOOL_CALLS]",),
    closes=None,
    bare_json=False,
    arguments_key="arguments",
    parallel=True,
    list_prefix="[TOOL_CALLS][",
    list_suffix="]",
    separator=", ",
    id_alphabet_length=9,
)
# Llama 3.1-3.3: a bare {"name": ..., "parameters": {...}}, maybe after <|python_tag|>.
LLAMA3 = ToolFormat(
    name="llama3",
    opens=("<|python_tag|>",),
    closes=None,
    bare_json=True,
    arguments_key="parameters",
    parallel=False,
)
# A template that renders tools in a way we do not know: the reply is taken to be JSON.
JSON = ToolFormat(
    name="json",
    opens=(),
    closes=None,
    bare_json=True,
    arguments_key="arguments",
    parallel=False,
)


def detect(template_source: str, renders_tools: bool) -> ToolFormat:
    """The format a template's model uses, from markers in the template's own text."""
    if "<tool_call>" in template_source:
        return HERMES
    if "[TOOL_CALLS]" in template_source:
        return MISTRAL
    if "<|python_tag|>" in template_source or (
        "<|start_header_id|>" in template_source and "ipython" in template_source
    ):
        return LLAMA3
    return JSON if renders_tools else GENERIC
