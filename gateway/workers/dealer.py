"""The gateway's DEALER socket to one worker: how it is set up, and sending and receiving
without waiting.

The socket queues nothing for a worker that is not connected (a message meant for a dead
worker must never reach the next one), reconnects by itself, carries CURVE keys when the
gateway has them, and reports its handshakes and disconnects on a monitor socket, which
WorkerClient watches.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections.abc import Awaitable
from typing import TypeVar, cast

import structlog
import zmq
import zmq.asyncio

from ...protocol.codec import MAX_FRAME_BYTES, encode
from ...protocol.messages import Message
from ..config import GatewayConfig
from .curve import set_curve_client
from .handshake import HANDSHAKE_FAILED

log = structlog.get_logger(__name__)

T = TypeVar("T")


def gateway_identity() -> str:
    """A name for this gateway process that no other gateway has: host, pid, random."""
    return f"gw-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def open_dealer(
    context: zmq.asyncio.Context, config: GatewayConfig, endpoint: str, identity: str
) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """A DEALER connecting to `endpoint` under `identity`, and its monitor socket (handshakes
    that succeeded or failed, disconnects)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 1024)
    sock.setsockopt(zmq.LINGER, 0)
    # Queue nothing for a worker that is not connected: a message meant for a dead
    # worker must never reach the next one.
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.setsockopt(zmq.IPV6, 1)  # a resolved worker address may be IPv6
    _set_curve(sock, config)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
    )
    sock.connect(endpoint)
    return sock, monitor


def send_now(sock: zmq.asyncio.Socket, message: Message) -> bool:
    """Send without waiting; False when the worker is not connected (nothing is queued)."""
    future = _future(sock.send_multipart(encode(message), flags=zmq.NOBLOCK, copy=False))
    if not future.done():
        future.add_done_callback(_log_send_failure)
        return True
    error = future.exception()
    if error is not None and not isinstance(error, zmq.Again):
        log.warning("send to worker failed", error=str(error))
    return error is None


def receive_now(sock: zmq.asyncio.Socket) -> list[bytes] | None:
    """The next message already in the socket; None when there is none."""
    try:
        return _future(sock.recv_multipart(flags=zmq.NOBLOCK)).result()
    except zmq.Again:
        return None


def _future(awaitable: Awaitable[T]) -> asyncio.Future[T]:
    """A zmq.asyncio socket call's result as what it is: pyzmq types it as an Awaitable, but
    returns an asyncio Future, which with NOBLOCK is often already done."""
    return cast("asyncio.Future[T]", awaitable)


def _set_curve(sock: zmq.Socket, config: GatewayConfig) -> None:
    """CURVE keys on the DEALER when the gateway has them (the worker then must, too)."""
    if config.curve_server_key_file is not None and config.curve_secret_key_file is not None:
        set_curve_client(sock, config.curve_server_key_file, config.curve_secret_key_file)


def _log_send_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("send to worker failed", error=str(future.exception()))
