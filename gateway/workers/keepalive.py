"""Keep-alives from a thread of their own: a gateway busy with a large request still speaks.

A worker cancels the requests of a gateway it has not heard from for its --gateway-timeout.
The gateway's pings come from its event loop, which can be held for seconds by one request
(a chat of 5,000 tools, a 7 MB body): every stream of that gateway would then be cancelled
although the gateway is fine. So a thread, which no request work waits in front of, sends
each worker a Ping naming the gateway's connection (Ping.for_gateway) on a socket of its own.

The thread only sends: the worker answers keep-alives with nothing, and the connection that
carries requests still judges the worker by what the worker sends it.
"""

from __future__ import annotations

import contextlib
import threading
import time

import zmq

from ...protocol.codec import encode
from ...protocol.messages import Ping
from ..config import GatewayConfig
from .curve import set_curve_client


class KeepAlive:
    """One thread, one DEALER per worker, a Ping per worker every heartbeat interval."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.interval = min(config.heartbeat_interval, config.worker_timeout / 4)
        # Worker endpoint -> the identity of the gateway's connection to it. The event loop
        # replaces the dict whole (watch), so the thread reads one version or the next.
        self._targets: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-keepalive", daemon=True)
        self.sent = 0  # keep-alives sent, for tests and logs

    def start(self) -> None:
        self._thread.start()

    def watch(self, targets: dict[str, str]) -> None:
        """The connections to keep alive from now on: worker endpoint -> gateway identity."""
        self._targets = dict(targets)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        context = zmq.Context()
        sockets: dict[tuple[str, str], zmq.Socket] = {}
        try:
            while not self._stop.wait(self.interval):
                targets = self._targets
                for key in [key for key in sockets if targets.get(key[0]) != key[1]]:
                    sockets.pop(key).close(linger=0)
                for key in targets.items():
                    sock = sockets.get(key)
                    if sock is None:
                        sock = sockets[key] = self._socket(context, *key)
                    ping = Ping(sent_at=time.time(), for_gateway=key[1])
                    with contextlib.suppress(zmq.Again):  # not connected: nothing to keep
                        sock.send_multipart(encode(ping), flags=zmq.NOBLOCK)
                        self.sent += 1
        finally:
            for sock in sockets.values():
                sock.close(linger=0)
            context.term()

    def _socket(self, context: zmq.Context, endpoint: str, identity: str) -> zmq.Socket:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{identity}-keepalive".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue pings for a worker that is not there
        sock.setsockopt(zmq.RCVHWM, 1)  # nothing is read here, and nothing should come
        sock.setsockopt(zmq.IPV6, 1)
        config = self.config
        if config.curve_server_key_file is not None and config.curve_secret_key_file is not None:
            set_curve_client(sock, config.curve_server_key_file, config.curve_secret_key_file)
        sock.connect(endpoint)
        return sock
