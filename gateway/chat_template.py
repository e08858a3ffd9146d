"""Chat messages to one prompt string, with the model's own Jinja template (as HF renders it)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

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

    @classmethod
    def for_model(cls, override: str | None, own: str | None, bos: str, eos: str) -> ChatTemplate:
        """The override when given, else the model's own template, else ChatML."""
        return cls(override or own or CHATML_TEMPLATE, bos, eos)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for messages (dicts with role and string content, and tool calls),
        with the OpenAI tool definitions the request gave (None, as HF passes, when none)."""
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
                raise_exception=_raise_exception,
                strftime_now=lambda fmt: datetime.now().strftime(fmt),
            )
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, RecursionError) as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from exc
