"""A timestamping proxy: what went over the wire during a run, seen from outside the bench.

The proxy sits between the load generator and the server and forwards bytes unchanged, both
ways, stamping every read with the time it arrived. Afterwards h11 parses each connection's
recorded bytes into requests and responses, the response bodies are split into server-sent
events, and each exchange gets the times of its request, of each event that carried text and
of its last byte. Nothing here is shared with the bench's own client (client.py): it is what
a packet capture would say, and crosscheck.py holds the bench's figures against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import h11

READ_SIZE = 65536
START_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Read:
    """Bytes one read took off a socket, and when (time.perf_counter)."""

    at: float
    upstream: bool  # client → server; False: server → client
    data: bytes


@dataclass(slots=True)
class Capture:
    """Every read of one proxied connection, in the order the proxy saw them."""

    opened_at: float  # when the client's connection reached the proxy
    reads: list[Read] = field(default_factory=list)


@dataclass(slots=True)
class Exchange:
    """One request and its response as they crossed the proxy. Times are perf_counter."""

    method: str
    path: str
    request_id: str | None  # the x-request-id header, which the bench sets per request
    sent_at: float  # the read that completed the request's head; the connection's opening
    # for the first request on a connection
    status: int | None = None
    text_at: list[float] = field(default_factory=list)  # each event that carried text
    ended_at: float | None = None  # the read that completed the response
    usage_tokens: int | None = None  # usage.completion_tokens of the stream's last events
    done: bool = False  # saw data: [DONE]

    @property
    def complete(self) -> bool:
        """A 200 stream that carried text and ended."""
        return self.status == 200 and bool(self.text_at) and self.ended_at is not None

    @property
    def output_tokens(self) -> int:
        """The server's own count when it reported one, else one token per text event."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.text_at)


def event_text(payload: dict[str, Any]) -> str:
    """The generated text of one completions or chat event (empty for role-only deltas)."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if choice.get("text"):
        return str(choice["text"])
    delta = choice.get("delta") or {}
    return str(delta.get("content") or delta.get("reasoning_content") or "")


class _EventStream:
    """Splits a response body into server-sent events, stamping each with its read's time."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.pending = b""

    def feed(self, data: bytes, at: float) -> None:
        self.pending += data.replace(b"\r\n", b"\n")
        *events, self.pending = self.pending.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip(), at)

    def _data(self, body: bytes, at: float) -> None:
        if body == b"[DONE]":
            self.exchange.done = True
            return
        try:
            payload = json.loads(body)
        except ValueError:
            return
        if not isinstance(payload, dict):
            return
        if event_text(payload):
            self.exchange.text_at.append(at)
        usage = payload.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.exchange.usage_tokens = int(usage["completion_tokens"])


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def parse_capture(capture: Capture) -> list[Exchange]:
    """The exchanges of one connection, replayed through h11 in the order the bytes came.

    h11 parses the requests as a server would and the responses as a client would; after each
    response the two parsers are walked to their next cycle together. A connection h11 cannot
    follow (a protocol error, an upgrade) keeps the exchanges parsed before it.
    """
    requests = h11.Connection(h11.SERVER)
    responses = h11.Connection(h11.CLIENT)
    exchanges: list[Exchange] = []
    current: Exchange | None = None
    events: _EventStream | None = None
    try:
        for read in capture.reads:
            if read.upstream:
                requests.receive_data(read.data)
                while (event := requests.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
                    if isinstance(event, h11.ConnectionClosed):
                        break  # h11 says so on every call after the end
                    if isinstance(event, h11.Request):
                        current = Exchange(
                            method=event.method.decode(),
                            path=event.target.decode(),
                            request_id=_header(list(event.headers), b"x-request-id"),
                            # A client that dials for a request starts its clock before it
                            # dials (vLLM's and ours do): the first request's time includes
                            # the connection's set-up.
                            sent_at=capture.opened_at if not exchanges else read.at,
                        )
                        exchanges.append(current)
                        events = _EventStream(current)
                        # The response parser must know a request went out (HEAD has no body).
                        responses.send(
                            h11.Request(
                                method=event.method, target=event.target, headers=[("host", "tap")]
                            )
                        )
                        responses.send(h11.EndOfMessage())
                continue
            responses.receive_data(read.data)
            while (event := responses.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
                if isinstance(event, h11.ConnectionClosed):
                    break
                if current is None or events is None:
                    raise h11.RemoteProtocolError("a response before any request")
                if isinstance(event, h11.Response):
                    current.status = event.status_code
                elif isinstance(event, h11.Data):
                    events.feed(bytes(event.data), read.at)
                elif isinstance(event, h11.EndOfMessage):
                    current.ended_at = read.at
                    # Walk the request parser through a response of its own, then both on.
                    requests.send(h11.Response(status_code=204, headers=[]))
                    requests.send(h11.EndOfMessage())
                    requests.start_next_cycle()
                    responses.start_next_cycle()
                    current, events = None, None
    except (h11.RemoteProtocolError, h11.LocalProtocolError):
        pass
    return exchanges


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    capture: Capture,
    upstream: bool,
) -> None:
    try:
        while data := await reader.read(READ_SIZE):
            if upstream:  # when the client's bytes reached the proxy
                capture.reads.append(Read(time.perf_counter(), upstream, data))
            writer.write(data)
            if not upstream:  # when the server's bytes were handed to the client's socket
                capture.reads.append(Read(time.perf_counter(), upstream, data))
            await writer.drain()
        # The end of the stream, recorded too: a response framed by closing needs it.
        capture.reads.append(Read(time.perf_counter(), upstream, b""))
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            writer.write_eof()


async def _proxy(upstream: tuple[str, int], control: Connection) -> None:
    """The proxy's process: listen, report the port, forward until told to stop, then send
    back every capture."""
    captures: list[Capture] = []
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        capture = Capture(time.perf_counter())
        captures.append(capture)
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError:
            writer.close()
            handlers.discard(task)
            return
        try:
            await asyncio.gather(
                _pump(reader, up_writer, capture, upstream=True),
                _pump(up_reader, writer, capture, upstream=False),
            )
        except asyncio.CancelledError:
            pass  # stopped with the connection open: end quietly, what was read is kept
        finally:
            for w in (writer, up_writer):
                w.close()
            handlers.discard(task)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    control.send(int(server.sockets[0].getsockname()[1]))
    await asyncio.to_thread(control.recv)  # "stop"
    server.close()
    for task in list(handlers):
        task.cancel()
    await asyncio.gather(*handlers, return_exceptions=True)
    control.send([(c.opened_at, [(r.at, r.upstream, r.data) for r in c.reads]) for c in captures])


def _proxy_main(upstream: tuple[str, int], control: Connection) -> None:
    asyncio.run(_proxy(upstream, control))


class TapProxy:
    """Forwards a 127.0.0.1 port to an upstream host:port, stamping every read, in a process
    of its own: it shares no interpreter lock with the load generator it watches.

        with TapProxy("127.0.0.1", 8000) as tap:
            run the load against tap.url
        exchanges = tap.exchanges()

    Bytes from the client are stamped as they reach the proxy, bytes from the server as the
    proxy hands them to the client's socket: the times are those of the client's side of the
    wire, less the loopback's microseconds.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.captures: list[Capture] = []
        self.port = 0
        context = multiprocessing.get_context("spawn")  # no fork of a threaded test process
        self._control, child = context.Pipe()
        self._process = context.Process(
            target=_proxy_main, args=(self.upstream, child), name="tap", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TapProxy:
        self._process.start()
        if not self._control.poll(START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the tap proxy did not start within {START_TIMEOUT_S} s")
        self.port = int(self._control.recv())
        return self

    def stop(self) -> None:
        """Close the listener and every proxied connection; keep what the proxy recorded."""
        if not self._process.is_alive():
            return
        self._control.send("stop")
        if self._control.poll(START_TIMEOUT_S):
            rows = self._control.recv()
            self.captures = [Capture(at, [Read(*row) for row in reads]) for at, reads in rows]
        self._process.join(timeout=10.0)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def exchanges(self) -> list[Exchange]:
        """Every exchange the proxy saw, in the order the requests went out (after stop)."""
        parsed = [exchange for capture in self.captures for exchange in parse_capture(capture)]
        return sorted(parsed, key=lambda e: e.sent_at)

    def __enter__(self) -> TapProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def tapped(upstream_url: str) -> Iterator[TapProxy]:
    """A TapProxy in front of an http://host:port URL, for the duration of the block."""
    rest = upstream_url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = rest.rpartition(":")
    with TapProxy(host or "127.0.0.1", int(port or 80)) as proxy:
        yield proxy
