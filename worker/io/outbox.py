"""The Sink the tick loop sends through in a worker process: messages wait in a deque for the
IO thread (sockets.py), and one byte over an inproc PAIR wakes that thread's poll to send them.
"""

from __future__ import annotations

import contextlib
from collections import deque

import zmq

from loomserve.protocol import Message

BROADCAST = b""  # the outbox's address for "every gateway" (no ROUTER identity is empty)


class Outbox:
    """The Sink the loop sends through: messages wait here for the IO thread, which one byte
    over an inproc PAIR wakes. send and flush are the loop thread's; broadcast any thread's."""

    def __init__(self, context: zmq.Context, wake_address: str) -> None:
        self.messages: deque[tuple[bytes, Message]] = deque()
        self._wake = context.socket(zmq.PAIR)
        self._wake.setsockopt(zmq.SNDHWM, 1)
        self._wake.setsockopt(zmq.LINGER, 0)
        self._wake.connect(wake_address)

    def send(self, gateway: bytes, message: Message) -> None:
        self.messages.append((gateway, message))

    def broadcast(self, message: Message) -> None:
        """Send a message to every known gateway (from any thread; it goes with the outbox)."""
        self.messages.append((BROADCAST, message))
        self.flush()

    def flush(self) -> None:
        """Wake the IO thread to send the outbox; one byte, never blocking."""
        # On EAGAIN a wake-up is already pending; it will find these messages too.
        with contextlib.suppress(zmq.Again):
            self._wake.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        self._wake.close(linger=0)
