"""The streaming client: sends one request to an OpenAI-compatible server and times its chunks.

Timing follows vLLM's benchmark: TTFT is the first chunk that carries a token, each later
one adds one inter-token latency, and the end-to-end latency runs to the last event of the
stream. One difference: an empty chunk before the end counts as a token, as llama.cpp's
servers send a token that is only part of a character; vLLM's benchmark skips it, and then
undercounts their tokens and fails an answer made only of such bytes. Failures are values on
the record, sorted by kind, never exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

import httpx

from .datasets import BenchRequest
from .records import (
    BAD_RESPONSE,
    BROKEN_STREAM,
    CONNECT_ERROR,
    NO_OUTPUT,
    STREAM_ERROR,
    TIMEOUT,
    TRANSPORT_ERROR,
    UNFINISHED,
    RequestRecord,
)

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# httpcore's trace events at which a request meets the wire: its connection is dialled, or
# its head written to a kept-alive one. A request's times run from there, not from when its
# task began: a burst of requests queues in our one event loop for tens of milliseconds on a
# busy machine, and that wait is the client's, not the server's.
WIRE_EVENTS = frozenset({"connection.connect_tcp.started", "http11.send_request_headers.started"})


def api_root(base_url: str) -> str:
    """The server root: users paste URLs ending in /v1 as often as not."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def build_payload(
    request: BenchRequest,
    model: str,
    endpoint: str,
    ignore_eos: bool,
    temperature: float,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of one streaming request, with usage reported at the end."""
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        messages = [{"role": role, "content": text} for role, text in request.history]
        messages.append({"role": "user", "content": request.prompt})
        if request.system_prompt:
            messages.insert(0, {"role": "system", "content": request.system_prompt})
        payload["messages"] = messages
    else:
        parts = [request.system_prompt] if request.system_prompt else []
        parts += [text for _, text in request.history]
        payload["prompt"] = "\n\n".join([*parts, request.prompt])
    if ignore_eos:
        payload["ignore_eos"] = True
    if request.priority is not None:
        payload["priority"] = request.priority
    if request.user is not None:
        payload["user"] = request.user
    if extra_body:
        payload.update(extra_body)
    return payload


def error_message(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, or the start of whatever came back."""
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (ValueError, AttributeError):
        pass
    return body[:300].decode("utf-8", "replace")


def chunk_text(event: dict[str, Any]) -> tuple[str | None, bool]:
    """The generated text in one stream event, and whether it carries a finish reason.

    The text is None when the event carries no token (a role-only delta, usage alone) and
    "" when it carries one whose bytes are not yet a whole character: llama-cpp-python's
    server streams those as empty chunks.
    """
    choices = event.get("choices")
    if not choices:
        return None, False
    choice = choices[0]
    text = choice.get("text")
    if text is None and (delta := choice.get("delta")):
        # A role-only first delta is an announcement, not a token: it must not count as TTFT.
        text = delta.get("content") or delta.get("reasoning_content")
        if not text and delta.get("tool_calls"):
            text = "<tool_call>"
        if text is None and "role" not in delta and isinstance(delta.get("content"), str):
            text = ""
    return text, choice.get("finish_reason") is not None


def is_token_event(text: str | None, finished: bool) -> bool:
    """Whether an event stands for one generated token, for servers that report no usage:
    one with text, or an empty one before the end (a token that is part of a character).
    An empty closing event only carries the finish reason."""
    return text is not None and (bool(text) or not finished)


def fallback_token_count(record: RequestRecord, max_tokens: Any) -> int:
    """Output tokens of a response that reported no usage.

    A stream that ended for length made max_tokens tokens, however its server grouped them
    into chunks (llama-cpp-python's sends a character's bytes as empty chunks, or as one
    chunk); otherwise each token event counts one.
    """
    if record.finish_reason == "length" and isinstance(max_tokens, int) and max_tokens > 0:
        return max_tokens
    return record.chunks


class StaleConnection(Exception):
    """A kept-alive connection turned out closed before the server answered anything."""


class StreamingClient:
    """Streams requests over HTTP/1.1 keep-alive connections, one per request in flight.

    Each connection is its own one-connection httpx client, kept on a free list: httpcore's
    shared pool scans every connection for every request, which at 32 in flight cost the
    client 2 ms of CPU per request; a free list costs the same at any concurrency.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        endpoint: str = "completions",
        api_key: str | None = None,
        timeout_s: float = 600.0,
        ignore_eos: bool = True,
        temperature: float = 0.0,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if endpoint not in ENDPOINT_PATHS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {endpoint!r}")
        self.model = model
        self.endpoint = endpoint
        self.url = api_root(base_url) + ENDPOINT_PATHS[endpoint]
        self.timeout_s = timeout_s
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.extra_body = extra_body
        self.text_chunks = 0  # across all requests, for the live progress bar
        # Request ids are UUIDs (some servers insist) ending in the request's index, so a
        # server's logs can be matched with the detailed results.
        self.id_prefix = str(uuid.uuid4())[:24]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ssl_context = httpx.create_ssl_context()  # 20 ms each: made once, shared
        self.idle: list[httpx.AsyncClient] = []  # connections free for the next request
        self.connections: list[httpx.AsyncClient] = []

    def _connection(self) -> tuple[httpx.AsyncClient, bool]:
        """A free kept-alive connection, or a new one when all are busy; and whether reused."""
        if self.idle:
            return self.idle.pop(), True
        return self._new_connection(), False

    def _new_connection(self) -> httpx.AsyncClient:
        connection = httpx.AsyncClient(
            headers=self.headers,
            verify=self.ssl_context,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            # The per-request deadline is enforced around the whole exchange; these only keep
            # httpx from giving up earlier.
            timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 30.0)),
        )
        self.connections.append(connection)
        return connection

    async def aclose(self) -> None:
        for connection in self.connections:
            await connection.aclose()
        self.connections.clear()
        self.idle.clear()

    async def send(
        self, request: BenchRequest, record: RequestRecord, clock_zero: float, deadline: float
    ) -> RequestRecord:
        """Send request, filling record; gives up at --timeout or at deadline (perf_counter)."""
        record.taken_up_s = time.perf_counter() - clock_zero
        payload = build_payload(
            request, self.model, self.endpoint, self.ignore_eos, self.temperature, self.extra_body
        )
        connection, reused = self._connection()
        # The clock starts once the request is ready to go: making a new connection's client
        # object costs a millisecond or more of our CPU, which is no part of the server's time
        # (dialling it, which happens in the exchange, is, as in vLLM's benchmark).
        start = time.perf_counter()
        record.start_s = start - clock_zero
        request_deadline = start + self.timeout_s
        stop = min(request_deadline, deadline)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + (stop - start)):
                try:
                    await self._exchange(connection, payload, record, start, reused)
                except StaleConnection:
                    # The server had closed this kept-alive connection (llama-server does
                    # after a few seconds idle) and never saw the request: dial anew, once.
                    self.idle.append(connection)
                    connection = self._new_connection()
                    await self._exchange(connection, payload, record, start, reused=False)
        except TimeoutError:
            kind = UNFINISHED if deadline < request_deadline else TIMEOUT
            self._fail(record, kind, f"no complete response after {stop - start:.1f} s")
        except httpx.TimeoutException as exc:
            self._fail(record, TIMEOUT, f"{type(exc).__name__}: {exc}")
        except httpx.ConnectError as exc:
            self._fail(record, CONNECT_ERROR, f"{exc}")
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.NetworkError) as exc:
            self._fail(record, BROKEN_STREAM, f"{type(exc).__name__}: {exc}")
        except httpx.HTTPError as exc:
            self._fail(record, TRANSPORT_ERROR, f"{type(exc).__name__}: {exc}")
        except (ValueError, AttributeError, TypeError) as exc:  # not JSON, or not OpenAI's shape
            self._fail(record, BAD_RESPONSE, f"{type(exc).__name__}: {exc}")
        finally:
            self.idle.append(connection)  # httpx drops a broken connection and dials anew
        return record

    @staticmethod
    def _fail(record: RequestRecord, kind: str, message: str) -> None:
        record.error_kind = kind
        record.error = message
        record.e2e_s = None

    async def _exchange(
        self,
        connection: httpx.AsyncClient,
        payload: dict[str, Any],
        record: RequestRecord,
        start: float,
        reused: bool,
    ) -> None:
        """POST and read the event stream; the hot path, so it does little per chunk."""
        record.request_id = f"{self.id_prefix}{record.index % 16**12:012x}"
        headers = {"x-request-id": record.request_id}
        on_wire: list[float] = []

        async def trace(event: str, info: dict[str, Any]) -> None:
            if not on_wire and event in WIRE_EVENTS:
                on_wire.append(time.perf_counter())

        async with contextlib.AsyncExitStack() as stack:
            try:
                response = await stack.enter_async_context(
                    connection.stream(
                        "POST",
                        self.url,
                        json=payload,
                        headers=headers,
                        extensions={"trace": trace},
                    )
                )
            except httpx.RemoteProtocolError as exc:
                if reused and "without sending a response" in str(exc):
                    raise StaleConnection from exc
                raise
            if on_wire:  # the clock restarts where the request met the wire (WIRE_EVENTS)
                record.start_s += on_wire[0] - start
                start = on_wire[0]
            if response.status_code != 200:
                body = await response.aread()
                record.error_kind = f"http_{response.status_code}"
                record.error = error_message(body)
                return
            pending = b""
            last_event = last_text = start
            finished_at: float | None = None  # when the finish reason came
            ended = False  # saw [DONE] or a finish reason
            loads = json.loads
            async for data in response.aiter_bytes():
                now = time.perf_counter()
                pending += data
                if b"\n" not in data:
                    continue
                lines = pending.split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments (": ping"), event names
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        ended = True
                        break
                    event = loads(body)
                    last_event = now
                    if event.get("error"):
                        record.error_kind = STREAM_ERROR
                        record.error = error_message(body)
                        return
                    text, finished = chunk_text(event)
                    if finished:
                        record.finish_reason = str(event["choices"][0]["finish_reason"])
                        finished_at = now
                    # Timed at every token, an empty one too: llama.cpp's servers stream a
                    # token that is part of a character as an empty chunk, and it was made.
                    if is_token_event(text, finished):
                        if record.ttft_s is None:
                            record.ttft_s = now - start
                        else:
                            record.itl_s.append(now - last_text)
                        last_text = now
                        record.chunks += 1
                        self.text_chunks += 1
                    ended = ended or finished
                    if usage := event.get("usage"):
                        record.usage_reported = True
                        record.output_tokens = usage.get("completion_tokens") or 0
                        record.prompt_tokens = usage.get("prompt_tokens")
                        if details := usage.get("prompt_tokens_details"):
                            record.cached_tokens = details.get("cached_tokens")
        if not ended:
            record.error_kind = BROKEN_STREAM
            record.error = "the stream ended before [DONE] or a finish reason"
            return
        if not record.usage_reported:
            record.output_tokens = fallback_token_count(record, payload.get("max_tokens"))
        if record.ttft_s is None and finished_at is not None and record.output_tokens > 0:
            # Every token came with the closing event: llama-server holds back the bytes of
            # an unfinished character, and an answer of only such bytes arrives at the end.
            record.ttft_s = finished_at - start
        if record.ttft_s is None:
            record.error_kind = NO_OUTPUT
            record.error = "the response carried no token"
        else:
            record.e2e_s = last_event - start
