"""The gateways the IO thread knows and what each has open, bounded however a peer behaves.

A gateway is a ROUTER identity: a peer gets one per connection it opens, and may send as many
Generates and Cancels as it likes. This table caps both. At most max_gateways are known at
once (silent ones expire); each may have max_open requests between its Generate and their
Finish or Rejected, and as many Generates for an id already open (the loop rejects those, in
order after the original's Accepted); a Cancel reaches the loop only for an open request,
and only once. So the loop's inbox holds at most max_gateways x 3 x max_open items.
No zmq here: the IO thread asks, this answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loomserve.protocol import ErrorCode


@dataclass(slots=True)
class GatewayState:
    """One known gateway."""

    last_seen: float
    open: set[str] = field(default_factory=set)  # handed to the loop; no Finish/Rejected yet
    cancelled: set[str] = field(default_factory=set)  # open ones a Cancel was passed on for
    duplicates: int = 0  # Generates for an open id, passed on for the loop to reject in order


class GatewayTable:
    """Known gateways, the ones given up on, and each one's open requests."""

    def __init__(self, max_gateways: int, max_open: int, lost_remembered: int) -> None:
        self.max_gateways = max_gateways
        self.max_open = max_open
        self.lost_remembered = lost_remembered
        self.known: dict[bytes, GatewayState] = {}
        self.lost: dict[bytes, None] = {}  # given up on, until they say Hello again

    def __len__(self) -> int:
        return len(self.known)

    def __contains__(self, gateway: bytes) -> bool:
        return gateway in self.known

    def can_admit(self, gateway: bytes) -> bool:
        """Whether admit() would take this gateway: known already, or room for one more."""
        return gateway in self.known or len(self.known) < self.max_gateways

    def admit(self, gateway: bytes, now: float) -> None:
        """It spoke: know it (check can_admit first), forgive it if it was lost."""
        state = self.known.get(gateway)
        if state is None:
            self.known[gateway] = GatewayState(last_seen=now)
            self.lost.pop(gateway, None)
        else:
            state.last_seen = now

    def open(self, gateway: bytes, request_id: str) -> tuple[ErrorCode, str] | None:
        """Record a Generate of a known gateway for the loop; why to reject it now, or None.

        A duplicate id goes on to the loop too: its Rejected then follows the original's
        Accepted, as the gateway expects of one id."""
        state = self.known[gateway]
        duplicate = request_id in state.open
        held = state.duplicates if duplicate else len(state.open)
        if held >= self.max_open:
            return (
                ErrorCode.QUEUE_FULL,
                f"this gateway has {len(state.open)} requests open, as many as the worker "
                "holds running and queued",
            )
        if duplicate:
            state.duplicates += 1
        else:
            state.open.add(request_id)
        return None

    def cancel(self, gateway: bytes, request_id: str) -> bool:
        """Whether a Cancel should reach the loop: an open request, not cancelled yet."""
        state = self.known.get(gateway)
        if state is None or request_id not in state.open or request_id in state.cancelled:
            return False
        state.cancelled.add(request_id)
        return True

    def close(self, gateway: bytes, request_id: str, duplicate: bool = False) -> None:
        """The loop finished or rejected the request (duplicate: rejected a second Generate
        for an id still open, which stays open)."""
        state = self.known.get(gateway)
        if state is None:
            return
        if duplicate:
            state.duplicates = max(0, state.duplicates - 1)
        else:
            state.open.discard(request_id)
            state.cancelled.discard(request_id)

    def silent(self, now: float, timeout: float) -> list[bytes]:
        """Known gateways that said nothing for longer than timeout."""
        return [gw for gw, state in self.known.items() if now - state.last_seen > timeout]

    def lose(self, gateway: bytes) -> bool:
        """Give up on a gateway (its requests are the loop's to cancel); False if unknown."""
        if self.known.pop(gateway, None) is None:
            return False
        self.lost[gateway] = None
        if len(self.lost) > self.lost_remembered:
            del self.lost[next(iter(self.lost))]
        return True
