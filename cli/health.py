"""Readiness probe of a worker over ZeroMQ: a Ping answered by a Heartbeat saying ready.

Used by `loomserve worker-health`, the compose health check of the worker service. When no
answer comes, the probe's socket monitor tells a worker that is down from one that refused
the handshake (CURVE keys that do not match), and the probe says which.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..gateway.workers.curve import set_curve_client
from ..gateway.workers.handshake import HANDSHAKE_FAILED, handshake_failure
from ..protocol.codec import DecodeError, decode, encode
from ..protocol.messages import Heartbeat, Ping


@dataclass(frozen=True, slots=True)
class Probe:
    """What one probe found: the worker's Heartbeat, or why none came when that is known."""

    beat: Heartbeat | None
    handshake_failure: str | None = None  # the handshake failed: why, in words


def probe(endpoint: str, timeout: float, curve: tuple[Path, Path] | None = None) -> Probe:
    """Ping the worker once; its Heartbeat, or the handshake's failure when there was one.

    curve: the worker's public certificate and the probe's secret one, for a CURVE worker.
    """
    context: zmq.Context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A readable name in the worker's logs instead of five random bytes.
    sock.setsockopt(zmq.IDENTITY, f"health-probe-{os.getpid()}-{time.monotonic_ns()}".encode())
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
    failure: str | None = None
    try:
        if curve is not None:
            set_curve_client(sock, *curve)
        sock.connect(endpoint)
        sent_at = time.time()
        sock.send_multipart(encode(Ping(sent_at=sent_at)))
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if not ready:
                break
            if monitor in ready:
                event = parse_monitor_message(monitor.recv_multipart())
                failure = handshake_failure(
                    int(event["event"]), int(event["value"]), curve is not None
                )
            if sock not in ready:
                continue
            try:
                message = decode(sock.recv_multipart())
            except DecodeError:
                continue
            # The echo of our Ping, or a periodic beat: either tells the worker's state.
            if isinstance(message, Heartbeat):
                return Probe(message)
        return Probe(None, failure)
    finally:
        # Before the monitor's end closes: libzmq's last monitor event would block close.
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(linger=0)
        sock.close()
