"""HTTP errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Under /v1/messages (Anthropic's API) in Anthropic's: {"type": "error", "error": {"type",
"message"}}, with Anthropic's error types.

Also the one place where the WorkerClient's transport errors become HTTP statuses.
"""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...protocol.messages import ErrorCode
from ..workers.errors import (
    ReaderTooSlow,
    WorkerBadOutput,
    WorkerClientError,
    WorkerFailed,
    WorkerLost,
    WorkerRejected,
    WorkerTimeout,
    WorkerUnavailable,
)

log = structlog.get_logger(__name__)


class APIError(Exception):
    """An error answered to the client with an HTTP status; raise it anywhere in a request."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body, also used as the payload of an SSE error event."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def anthropic_body(self) -> dict[str, Any]:
        """The body in Anthropic's shape."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response_for(self, request: Request) -> JSONResponse:
        """The response in the shape of the API the request came to."""
        return self.response_for_path(request.url.path)

    def response_for_path(self, path: str) -> JSONResponse:
        """The response in the shape of the API at `path`: Anthropic's under /v1/messages."""
        if path.startswith(ANTHROPIC_PREFIX):
            body = self.anthropic_body()
            return JSONResponse(body, status_code=self.status, headers=self.headers)
        return self.response()


ANTHROPIC_PREFIX = "/v1/messages"
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def invalid_request(message: str, param: str | None = None) -> APIError:
    """400: the request itself is wrong."""
    return APIError(400, message, param=param, code="invalid_request")


def unavailable(message: str, code: str = "worker_unavailable", retry_after: int = 1) -> APIError:
    """503: try again later; the Retry-After header says when."""
    headers = {"Retry-After": str(retry_after)}
    return APIError(503, message, type="unavailable_error", code=code, headers=headers)


def server_error(message: str) -> APIError:
    """500: the engine failed the request."""
    return APIError(500, message, type="server_error", code="internal_error")


def worker_error(error: WorkerClientError) -> APIError:
    """The HTTP error for what went wrong between the gateway and the worker."""
    match error:
        case WorkerUnavailable() | WorkerLost():
            return unavailable(error.message)
        case WorkerRejected(code=ErrorCode.QUEUE_FULL):
            return unavailable(
                f"the server is busy: {error.message}", code="queue_full", retry_after=1
            )
        case WorkerRejected(code=ErrorCode.PROMPT_TOO_LONG):
            return APIError(400, error.message, code="context_length_exceeded")
        case WorkerRejected(code=ErrorCode.INVALID_REQUEST):
            return invalid_request(error.message)
        case WorkerRejected(code=ErrorCode.NOT_READY):
            return unavailable(f"the worker is not ready: {error.message}")
        case WorkerRejected(code=code):
            return server_error(f"the worker refused the request ({code}): {error.message}")
        case WorkerFailed(code=ErrorCode.INVALID_REQUEST):
            return invalid_request(error.message)
        case WorkerFailed():
            return server_error(f"the engine failed the request: {error.message}")
        case WorkerTimeout():
            # Not the client's fault: a timeout type, and when to try again (a busy server
            # runs requests longer; the retry may find it freer).
            return APIError(
                504,
                error.message,
                type="timeout_error",
                code="timeout",
                headers={"Retry-After": "1"},
            )
        case ReaderTooSlow():
            return APIError(408, error.message, code="reader_too_slow")
        case WorkerBadOutput():
            return APIError(502, error.message, type="server_error", code="bad_worker_output")
        case _:
            return server_error(error.message)


def install_handlers(app: FastAPI) -> None:
    """Answer every error, validation and routing ones included, in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response_for(request)

    @app.exception_handler(WorkerClientError)
    async def _worker_error(request: Request, exc: WorkerClientError) -> JSONResponse:
        return worker_error(exc).response_for(request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response_for(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {401: "authentication_error", 404: "not_found_error"}
        error = APIError(
            exc.status_code,
            str(exc.detail),
            type=kinds.get(exc.status_code, "invalid_request_error"),
            headers=getattr(exc, "headers", None),
        )
        return error.response_for(request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", path=request.url.path)
        return server_error(f"internal error: {type(exc).__name__}").response_for(request)


def validation_error(errors: Any) -> APIError:
    """400 from pydantic's errors (FastAPI would say 422), naming the first offending field."""
    errors = list(errors)
    if not errors:
        return invalid_request("the request is not valid")
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = location[0] if location else None  # OpenAI names the top-level field
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        message, param = f"the body is not valid JSON: {first.get('ctx', {}).get('error')}", None
    elif not param:
        message = "the body must be a JSON object (Content-Type: application/json)"
    else:
        message = f"{'.'.join(location)}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return invalid_request(message, param)
