"""The server span of each API request, when tracing is on (gateway/tracing.py).

Pure ASGI, outside the access middleware: the span covers the whole exchange, a stream's
last event included, and is the current span while the route runs, so the spans the
request makes (generation, routing, the stream back) are its children. Its parent is the
client's W3C traceparent when it sent one. Polled paths (probes, /metrics, /slots, /status)
get none: they would bury the requests in traces.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loomserve.gateway import tracing
from loomserve.gateway.http.middleware import QUIET_PATHS

TRACE_HEADERS = {b"traceparent": "traceparent", b"tracestate": "tracestate"}


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

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
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
            tracing.end(span, attributes, error=f"HTTP {status}" if status >= 500 else "")
