"""What a tick says to each gateway: one Outputs per gateway, filled during the tick (tokens,
prompt logprobs, finishes) and sent together at its end. Plain Python."""

from __future__ import annotations

from typing import Protocol

from loomserve.protocol import Message, Outputs


class Sink(Protocol):
    """Where the loop's messages go: the IO thread's outbox, or a list in a test."""

    def send(self, gateway: bytes, message: Message) -> None: ...

    def flush(self) -> None: ...


class PendingOutputs:
    """This tick's Outputs, by gateway."""

    def __init__(self) -> None:
        self._by_gateway: dict[bytes, Outputs] = {}

    def to(self, gateway: bytes) -> Outputs:
        outputs = self._by_gateway.get(gateway)
        if outputs is None:
            outputs = self._by_gateway[gateway] = Outputs(tokens=[], finishes=[])
        return outputs

    def send(self, sink: Sink) -> None:
        """Send every gateway its Outputs, if any, and start over."""
        if self._by_gateway:
            for gateway, outputs in self._by_gateway.items():
                sink.send(gateway, outputs)
            self._by_gateway = {}
            sink.flush()
