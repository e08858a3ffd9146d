"""uvicorn's h11 protocol with a deadline on each request's headers (slowloris), and each
connection's transport where a stream can find it (generate/streaming.py's send buffer).

uvicorn times out idle keep-alive connections, but not a connection that sends its request
line and headers a byte at a time, or nothing at all: a thousand of those held a thousand
file descriptors for ever. Here a connection gets `header_timeout` seconds from its first
byte (or from its opening) to complete the headers of each request, or it is closed.

"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..generate.streaming import TRANSPORT_STATE


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request headers take too long."""

    header_timeout = 10.0  # set per server by with_header_timeout

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type[HeaderTimeoutProtocol]:
        """This class with its own header timeout (uvicorn builds protocols by class)."""
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.app_state = {**self.app_state, TRANSPORT_STATE: transport}
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm()  # bytes of a request whose headers are not complete yet
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        waiting_for_headers = self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete
        )
        if waiting_for_headers and not self.transport.is_closing():
            self.transport.close()
