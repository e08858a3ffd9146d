"""The server span of each API request, when tracing is on (gateway/tracing.py).

Pure ASGI, outside the access middleware: the span covers the whole exchange, a stream's
last event included, and is the current span while the route runs, so the spans the
request makes (generation, routing, the stream back) are its children. Its parent is the
client's W3C traceparent when it sent one. Polled paths (probes, /metrics, /slots, /status)
get none: they would bury the requests in traces.

A request answered with an error (refused by a middleware, a route, or the worker after it
took the request) gets a `loomserve.refused` event on this span with the error's code and
message, read from the JSON body: the trace says why, not only the status. A stream refused
once its events have begun says so on its `gateway.stream` span (generate/streaming.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import tracing
from .middleware import QUIET_PATHS

TRACE_HEADERS = {b"traceparent": "traceparent", b"tracestate": "tracestate"}
# An error body is a few hundred bytes; more than this is not an error of ours.
ERROR_BODY_BYTES = 64 * 1024


class TracingMiddleware:
    """One SERVER span per HTTP request: method, route, status, and the request's id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in QUIET_PATHS:
            await self.app(scope, receive, send)
            return
        carrier = {
            TRACE_HEADERS[key]: value.decode("latin-1")
            for key, value in scope["headers"]
            if key in TRACE_HEADERS
        }
        method = scope["method"]
        span = tracing.start_span(
            f"{method} {scope['path']}",
            {"http.request.method": method, "url.path": scope["path"]},
            parent=tracing.extract(carrier),
            kind="SERVER",
        )
        status = 500
        error_body: bytearray | None = None  # kept only for a JSON error answer

        async def record(message: Message) -> None:
            nonlocal status, error_body
            if message["type"] == "http.response.start":
                status = message["status"]
                if status >= 400 and _is_json(message.get("headers", ())):
                    error_body = bytearray()
            elif message["type"] == "http.response.body" and error_body is not None:
                error_body += message.get("body", b"")[: ERROR_BODY_BYTES - len(error_body)]
            await send(message)

        try:
            with tracing.use(span):
                await self.app(scope, receive, record)
        finally:
            route = getattr(scope.get("route"), "path", None)
            attributes: dict[str, str | int] = {"http.response.status_code": status}
            if route and span is not None:
                span.update_name(f"{method} {route}")  # the route, not each URL: few names
                attributes["http.route"] = route
            request_id = scope.get("state", {}).get("request_id")
            if request_id:
                attributes["loomserve.request_id"] = request_id
            if error_body is not None:
                tracing.event(span, "loomserve.refused", refusal(status, bytes(error_body)))
            tracing.end(span, attributes, error=f"HTTP {status}" if status >= 500 else "")


def _is_json(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    for key, value in headers:
        if key.lower() == b"content-type":
            return value.startswith(b"application/json")
    return False


def refusal(status: int, body: bytes) -> dict[str, str]:
    """The event's attributes for an error answer: its code (else its type, else the status)
    and its message, from OpenAI's shape or Anthropic's ({"type": "error", "error": {...}})."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if not isinstance(error, dict):
        return {"error.type": str(status), "loomserve.error.message": ""}
    kind = error.get("code") or error.get("type") or status
    return {"error.type": str(kind), "loomserve.error.message": str(error.get("message", ""))}
