"""Pure ASGI middleware: the body size limit, API keys, and one log line and metric per
request."""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..api.errors import APIError, invalid_request
from ..config import PriorityRange
from ..metrics import GatewayMetrics

log = structlog.get_logger(__name__)

# Polled (by probes, Prometheus, the /status page): logged only when they fail.
QUIET_PATHS = frozenset({"/health", "/live", "/metrics", "/slots", "/status"})
# `serve`'s readiness probe polls /health until it answers 200: its 503s while the workers
# load are expected, and not logged (cli/serve.py sends this User-Agent).
READY_PROBE_AGENT = "loomserve-serve-ready-probe"
# A client's X-Request-Id is taken as the request's id when it looks like one.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


# The API's paths without their /v1, as llama-server and vLLM-style proxies also answer them:
# a client given a bare base URL (http://host:8000) still finds them. /models/load and
# /models/unload are the model manager's own routes, never an alias.
BARE_PATHS = frozenset(
    {
        "/chat/completions",
        "/completions",
        "/embeddings",
        "/models",
        "/responses",
        "/responses/input_tokens",
        "/messages",
        "/messages/count_tokens",
    }
)
MANAGER_PATHS = frozenset({"/models/load", "/models/unload"})


def v1_path(method: str, path: str) -> str | None:
    """The /v1 route a bare API path stands for; None for any other path."""
    if path in BARE_PATHS:
        return "/v1" + path
    if method == "GET" and path.startswith("/models/") and path not in MANAGER_PATHS:
        return "/v1" + path  # one model's card
    return None


class BarePathMiddleware:
    """Routes the bare paths (v1_path) to their /v1 routes, before anything reads the path:
    keys, error shapes and logs see the one route. /openapi.json lists each route once."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            routed = v1_path(scope["method"], scope["path"])
            if routed is not None:
                scope = {**scope, "path": routed, "raw_path": routed.encode()}
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over max_bytes, by Content-Length or by counting a streamed body; 408
    for a body that takes longer than timeout to arrive (a slow-body attack holds no slot).

    The body is read here (FastAPI reads it whole anyway) and replayed to the app; later
    receive() calls go to the server, so the app still sees the client's disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float = 60.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            413,
            f"the request body is larger than {self.max_bytes} bytes",
            code="request_too_large",
        )
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await invalid_request("bad Content-Length header").response()(scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                await too_large.response()(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client left before it finished sending
                    body = message.get("body", b"")
                    size += len(body)
                    if size > self.max_bytes:
                        await too_large.response()(scope, receive, send)
                        return
                    chunks.append(body)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            too_slow = APIError(
                408,
                f"the request body did not arrive within {self.timeout:g}s",
                code="request_timeout",
                headers={"Connection": "close"},
            )
            await too_slow.response()(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class AccessMiddleware:
    """Gives each request its id, counts every response by route and status, and logs it.

    The id is the client's X-Request-Id when it sends a usable one, else a fresh one; every
    log line about the request carries it, the response echoes it in X-Request-Id, and the
    routes find it in `request.state.request_id`.
    """

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        structlog.contextvars.clear_contextvars()
        started = time.monotonic()
        status = 500
        given = _header(scope, b"x-request-id")
        request_id = given if given and REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        structlog.contextvars.bind_contextvars(request_id=request_id)

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "other")
            self.metrics.http_requests.labels(path, str(status)).inc()
            quiet = scope["path"] in QUIET_PATHS
            probing = quiet and _header(scope, b"user-agent") == READY_PROBE_AGENT
            if not quiet or (status >= 400 and not probing):
                log.info(
                    "http request",
                    method=scope["method"],
                    path=scope["path"],
                    status=status,
                    seconds=round(time.monotonic() - started, 4),
                )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1").strip()
    return None


# Open without a key: probes, metrics, the status page (its data comes from /slots, which
# needs one) and the API's documentation.
OPEN_PATHS = frozenset({"/health", "/live", "/metrics", "/status", "/openapi.json"})
OPEN_PREFIXES = ("/docs", "/redoc")


class AuthMiddleware:
    """401 for a request without a valid API key, when keys are set; the key's tenant,
    priority bounds and whether it is an admin's go on the request's state (fair shares,
    metrics, priorities, what /slots shows).

    A key comes as `Authorization: Bearer <key>`, or as `x-api-key: <key>` as Anthropic's
    clients send it. Every key is compared, so the time taken says nothing about which one
    matched. CORS preflights never get here: the CORS middleware, outside this one, answers them.
    """

    def __init__(
        self,
        app: ASGIApp,
        tenants: dict[str, str],
        priorities: dict[str, PriorityRange],
        admins: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.keys = [(key.encode(), key) for key in tenants]
        self.tenants = tenants
        self.priorities = priorities
        self.admins = admins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.keys or _is_open(path):
            await self.app(scope, receive, send)
            return
        key = self._matching_key(scope)
        if key is None:
            error = APIError(
                401,
                "missing or invalid API key; send it as 'Authorization: Bearer <key>' "
                "(or 'x-api-key: <key>')",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response_for_path(path)(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["tenant"] = self.tenants[key]
        state["priorities"] = self.priorities.get(key)
        state["admin"] = key in self.admins
        await self.app(scope, receive, send)

    def _matching_key(self, scope: Scope) -> str | None:
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        if not token:
            api_key = _header(scope, b"x-api-key")
            if api_key is not None:
                scheme, token = "bearer", api_key
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode()
        matched = [key for encoded, key in self.keys if hmac.compare_digest(given, encoded)]
        return matched[0] if matched else None


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)
