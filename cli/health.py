"""Readiness probe of a worker over ZeroMQ: a Ping answered by a Heartbeat saying ready.

Used by `loomserve worker-health`, the compose health check of the worker service.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import zmq

from loomserve.gateway.workers.curve import set_curve_client
from loomserve.protocol.codec import DecodeError, decode, encode
from loomserve.protocol.messages import Heartbeat, Ping


def probe_worker(
    endpoint: str, timeout: float, curve: tuple[Path, Path] | None = None
) -> Heartbeat | None:
    """The worker's answer to one Ping, or None when none came within `timeout` seconds.

    curve: the worker's public certificate and the probe's secret one, for a CURVE worker.
    """
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A readable name in the worker's logs instead of five random bytes.
    sock.setsockopt(zmq.IDENTITY, f"health-probe-{os.getpid()}-{time.monotonic_ns()}".encode())
    try:
        if curve is not None:
            set_curve_client(sock, *curve)
        sock.connect(endpoint)
        sent_at = time.time()
        sock.send_multipart(encode(Ping(sent_at=sent_at)))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                break
            try:
                message = decode(sock.recv_multipart())
            except DecodeError:
                continue
            # The echo of our Ping, or a periodic beat: either tells the worker's state.
            if isinstance(message, Heartbeat):
                return message
        return None
    finally:
        sock.close()
