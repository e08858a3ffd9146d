"""Chat messages to one prompt string: the model's own Jinja template (as HF renders it), or,
for a model that ships none, llama.cpp's built-in template for its architecture.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import llama_cpp
from jinja2.sandbox import ImmutableSandboxedEnvironment

# llama.cpp's built-in template for a model architecture (GGUF `general.architecture`) whose
# chat format does not depend on the checkpoint; base models of these families ship without a
# template. Architectures not listed here get ChatML, as llama-server gives them.
BUILTIN_BY_ARCHITECTURE = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "phi3": "phi3",
    "command-r": "command-r",
    "cohere2": "command-r",
    "exaone": "exaone3",
    "exaone4": "exaone4",
    "granite": "granite",
    "qwen2": "chatml",
    "qwen2moe": "chatml",
    "qwen3": "chatml",
    "qwen3moe": "chatml",
    "chatglm": "chatglm4",
    "llama4": "llama4",
    "minicpm": "minicpm",
}

# ChatML: what llama-server falls back to when a model ships no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template could not render these messages; the request is at fault (HTTP 400)."""


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """HF templates may mark assistant text with {% generation %}; it renders as plain text."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

    def parse(self, parser: Any) -> Any:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    # HF's tojson keeps non-ASCII as is, unlike jinja2's HTML-safe default.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


class Renderer(Protocol):
    """What the gateway needs of a chat template: messages (and tools) in, prompt text out."""

    source: str  # the template's text, where tool_format.detect looks for a call syntax

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str: ...


def builtin_templates() -> list[str]:
    """The names of llama.cpp's built-in chat templates (gemma, llama3, chatml, ...)."""
    count = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * count)()
    llama_cpp.llama_chat_builtin_templates(names, count)
    return [name.decode() for name in names]


def override_origin(value: str) -> str:
    """Where a --chat-template value's template comes from, as the log names it (the file's
    path, the built-in's name); call before load_override, which replaces a path by its text."""
    if value in builtin_templates():
        return f"--chat-template {value} (llama.cpp built-in)"
    if _is_file(value):
        return f"--chat-template {value}"
    return "--chat-template (Jinja text)"


def load_override(value: str) -> str:
    """What --chat-template gives the gateway: a built-in name as it is, a file's text, or
    Jinja text; the Jinja compiled once here, so a mistake fails at start-up.

    Raises ValueError, naming the built-in templates, for a value that is none of these (a
    mistyped name, a file that does not exist): taken as text, it would become every chat's
    literal prompt."""
    names = builtin_templates()
    if value in names:
        return value
    if _is_file(value):
        try:
            text = Path(value).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value}: cannot read it ({exc})") from exc
        where = f"--chat-template {value}"
    elif "{{" in value or "{%" in value:
        text, where = value, "--chat-template"
    else:
        raise ValueError(
            f"--chat-template {value!r} is not a llama.cpp built-in template, a file or Jinja "
            f"text ({{{{ or {{%); the built-in names: {', '.join(sorted(names))}"
        )
    try:
        ChatTemplate(text, "", "")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return text


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # template text too long for a file name, or with a NUL
        return False


class BuiltinChatTemplate:
    """One of llama.cpp's built-in templates, by name, rendered by llama_chat_apply_template."""

    def __init__(self, name: str) -> None:
        if name not in builtin_templates():
            raise ValueError(f"llama.cpp has no built-in chat template named {name!r}")
        self.name = name
        self.source = ""  # no Jinja: the format is C++ code in llama.cpp

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for messages (each a dict with role and string content). Tools are
        not rendered: tools/template.py probes that, and writes them as a system prompt; nor
        are kwargs (chat_template_kwargs): the format is C++ code that reads none."""
        # The C strings must live until the call returns: keep the encoded bytes here.
        encoded = [(m["role"].encode(), str(m.get("content") or "").encode()) for m in messages]
        chat = (llama_cpp.llama_chat_message * len(encoded))(
            *(llama_cpp.llama_chat_message(role=r, content=c) for r, c in encoded)
        )
        size = 2 * sum(len(r) + len(c) for r, c in encoded) + 256
        for _ in range(2):  # the first call says how much room the text needs
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(
                self.name.encode(), chat, len(encoded), add_generation_prompt, buffer, size
            )
            if n < 0:
                raise ChatTemplateError(f"the {self.name} chat template failed on these messages")
            if n <= size:
                return buffer.raw[:n].decode("utf-8", errors="replace")
            size = n
        raise ChatTemplateError(f"the {self.name} chat template gave no stable length")


@dataclass(frozen=True, slots=True)
class ChosenTemplate:
    """The template the gateway renders chats with, and where it came from (for the log)."""

    renderer: Renderer
    origin: str  # "--chat-template", "the model's", or "built-in <name> for <architecture>"
    fallback: bool  # the model ships no template: the choice was ours, and is logged as such


def choose_template(
    override: str | None, own: str | None, architecture: str, bos: str, eos: str
) -> ChosenTemplate:
    """--chat-template (a built-in name, or Jinja), else the model's own, else the built-in
    template of its architecture, else ChatML."""
    if override:
        if override in builtin_templates():
            return ChosenTemplate(BuiltinChatTemplate(override), f"built-in {override}", False)
        return ChosenTemplate(ChatTemplate(override, bos, eos), "--chat-template", False)
    if own:
        return ChosenTemplate(ChatTemplate(own, bos, eos), "the model's", False)
    name = BUILTIN_BY_ARCHITECTURE.get(architecture)
    if name is None:
        return ChosenTemplate(ChatTemplate(CHATML_TEMPLATE, bos, eos), "ChatML", True)
    return ChosenTemplate(BuiltinChatTemplate(name), f"llama.cpp's built-in {name!r}", True)


class ChatTemplate:
    """A compiled chat template, rendered in jinja2's sandbox with the variables HF passes."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        environment = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols],
        )
        environment.filters["tojson"] = _tojson
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text for messages (dicts with role and string content, and tool calls),
        with the OpenAI tool definitions the request gave (None, as HF passes, when none) and
        chat_template_kwargs as more variables (enable_thinking...; they cannot replace the
        ones HF passes). A template that loops over the tools even when there are none
        (Command R+'s tool-use template) gets an empty list instead of None."""
        try:
            return self._render(messages, add_generation_prompt, tools, kwargs)
        except TypeError as exc:
            failed = ChatTemplateError(f"the chat template failed on these messages: {exc}")
            if tools is not None or "NoneType" not in str(exc):
                raise failed from exc
            try:
                return self._render(messages, add_generation_prompt, [], kwargs)
            except TypeError:
                raise failed from exc  # not the tools after all: the first failure

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
    ) -> str:
        """render's one try; TypeError left to the caller."""
        try:
            variables = {
                "messages": messages,
                "tools": tools,
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "add_generation_prompt": add_generation_prompt,
                "raise_exception": _raise_exception,
                "strftime_now": lambda fmt: datetime.now().strftime(fmt),
            }
            return self._template.render({**(kwargs or {}), **variables})
        except (ChatTemplateError, TypeError):
            raise
        except (jinja2.TemplateError, ValueError, KeyError, RecursionError) as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc
