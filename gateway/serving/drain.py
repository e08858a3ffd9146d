"""Draining a gateway on SIGTERM: stop admitting, let open requests finish, then cut the rest.

While it drains the gateway still answers: /health and new generation requests get 503 with
Retry-After (so a load balancer moves away and clients retry elsewhere), and the requests
already running get `shutdown_timeout` seconds to finish. Those still open then end with an
error (an SSE error event for a stream), and the server exits.
"""

from __future__ import annotations

import time

import structlog

from ..generate.group import GenerationGroup
from ..workers.errors import WorkerLost

log = structlog.get_logger(__name__)

CUT_GRACE_SECONDS = 1.0  # after cutting the last requests, time for their error to go out


class Drain:
    """The open generations of one gateway, and whether (and until when) it drains."""

    def __init__(self) -> None:
        self.open: dict[str, GenerationGroup] = {}
        self.draining = False
        self._deadline = 0.0
        self._cut_at: float | None = None

    def track(self, group: GenerationGroup) -> None:
        self.open[group.request.id] = group

    def untrack(self, group: GenerationGroup) -> None:
        self.open.pop(group.request.id, None)

    def start(self, timeout: float) -> None:
        """Stop admitting; open requests have `timeout` seconds from now."""
        if self.draining:
            return
        self.draining = True
        self._deadline = time.monotonic() + timeout
        log.info("draining", open_requests=len(self.open), timeout_s=timeout)

    def done(self) -> bool:
        """Whether the server may stop now; cuts the open requests once the time is up."""
        if not self.draining:
            return False
        if not self.open:
            return True
        now = time.monotonic()
        if self._cut_at is None and now >= self._deadline:
            self._cut_at = now
            log.warning("drain timed out; ending the open requests", open_requests=len(self.open))
            for group in list(self.open.values()):
                group.interrupt(WorkerLost("the gateway is shutting down; retry the request"))
        return self._cut_at is not None and now >= self._cut_at + CUT_GRACE_SECONDS
