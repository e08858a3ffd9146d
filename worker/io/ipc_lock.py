"""One worker per ipc:// path: a lock file beside the socket, held for the worker's life.

ZeroMQ binds an ipc path by unlinking whatever socket file is there, so a second worker
started on the same path would silently take the gateways over from a live first one. An
flock ends with its process however that ends, so a crashed worker leaves no stale lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class EndpointInUse(RuntimeError):
    """Another live worker serves this endpoint."""


class IpcLock:
    """The held lock on an ipc path; release() at exit (or let the process end)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def lock_path(endpoint: str) -> Path | None:
    """The lock file guarding an ipc endpoint; None for other transports (tcp fails to bind
    a port in use by itself) and for Linux's abstract sockets (ipc://@name, the same)."""
    if not endpoint.startswith("ipc://"):
        return None
    socket_path = endpoint.removeprefix("ipc://")
    if socket_path.startswith("@"):
        return None
    path = Path(socket_path)
    return path.with_name(path.name + ".lock")


def claim_endpoint(endpoint: str) -> IpcLock | None:
    """Lock an ipc endpoint for this process; EndpointInUse when a live worker holds it."""
    path = lock_path(endpoint)
    if path is None:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ""
        with contextlib.suppress(OSError, ValueError):
            holder = f" (pid {int(os.pread(fd, 32, 0))})"
        os.close(fd)
        raise EndpointInUse(
            f"another worker{holder} serves {endpoint}; stop it first or bind another path"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)  # who holds it, for the message above
    return IpcLock(path, fd)
