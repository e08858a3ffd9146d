"""structlog set-up: readable lines on a terminal, JSON lines elsewhere or on request."""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.typing import ExceptionRenderer, Processor


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    """Route structlog and the standard library's logging through one renderer."""
    if json is None:
        json = not sys.stderr.isatty()
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=_console_traceback(sys.stderr.isatty())
        )
    )
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        cache_logger_on_first_use=True,
    )
    # JSON lines carry an exception as a structured traceback: the console renderer prints
    # exc_info itself, but JSONRenderer would drop it. structlog's dict_tracebacks shows
    # every frame's locals, where prompts, keys and request bodies live: leave them out.
    without_locals = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
    exceptions = [structlog.processors.ExceptionRenderer(without_locals)] if json else []
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *exceptions,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _console_traceback(colors: bool) -> ExceptionRenderer:
    """Tracebacks for the console, without frame locals (rich shows them by default)."""
    if getattr(structlog.dev, "rich", None) is None:  # rich is not installed
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(
        color_system="truecolor" if colors else None, show_locals=False
    )
