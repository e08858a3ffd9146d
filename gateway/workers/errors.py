"""What can go wrong between the gateway and the worker, as the WorkerClient raises it.

These are transport outcomes, not HTTP: `errors.worker_error` is the one place that gives
each its status. "Never ran" below means the worker holds no trace of the request, so it
could be sent again (to this worker or another) without generating twice.
"""

from __future__ import annotations


class WorkerClientError(Exception):
    """A request the worker could not serve; `message` says why in words for the client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class WorkerUnavailable(WorkerClientError):
    """No worker can take the request now (not connected, not ready, incompatible, silent).

    The request never ran.
    """


class WorkerRejected(WorkerClientError):
    """The worker refused the request with an ErrorCode (queue full, prompt too long...).

    The request never ran.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # an ErrorCode value


class WorkerLost(WorkerClientError):
    """The worker went away, or the gateway is closing, while the request was open.

    Tokens already handed out stay valid; whatever the worker did after them is lost.
    """


class WorkerFailed(WorkerClientError):
    """The engine failed the request after it started (a Finish with reason error)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code  # an ErrorCode value when the request's own settings failed it


class WorkerBadOutput(WorkerClientError):
    """The worker's output for the request broke the protocol (a token repeated, skipped, after
    the finish, or outside the vocabulary); the request ends, the gateway serves on."""


class WorkerTimeout(WorkerClientError):
    """The request's deadline passed while it waited for the worker's output."""


class ReaderTooSlow(WorkerClientError):
    """The client did not read its output: more than the gateway's bound of tokens waited for
    it, so the request was cancelled in the worker (its slot freed for others)."""
