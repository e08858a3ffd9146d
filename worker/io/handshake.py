"""HandshakeWatch: the worker logs the connections whose ZeroMQ handshake it refused.

A gateway with the wrong CURVE server key sends a HELLO this worker cannot decrypt; libzmq
drops the connection and tells nobody but the socket monitor. This thread reads the ROUTER's
monitor events and logs each kind of failure (the first, then every REFUSALS_LOGGED_EVERY-th),
so that both ends of a misconfigured pair say what is wrong. Refused keys are logged by the
allow-list (curve.AllowList) with the key itself, so an auth failure adds nothing here.
"""

from __future__ import annotations

import contextlib
import threading

import structlog
import zmq
from zmq.utils.monitor import parse_monitor_message

from .curve import REFUSALS_LOGGED_EVERY

log = structlog.get_logger(__name__)

WATCHED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
POLL_MS = 200  # how often the thread looks whether it should stop


def handshake_refusal(event: int, value: int, curve: bool) -> str | None:
    """Why the worker refused a connection's handshake, in words; None for other events.

    curve: whether this worker requires CURVE.
    """
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return (
                "a client's CURVE handshake failed a cryptographic check: it does not hold "
                "this worker's public key (its --curve-server-key-file must be this worker's "
                ".key file)"
            )
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if curve:
                return (
                    "a client connected without CURVE; this worker requires it (give the "
                    "gateway --curve-server-key-file and --curve-secret-key-file)"
                )
            return "a client connected with CURVE keys; this worker runs without CURVE"
        return f"a client's handshake broke the protocol (libzmq error {value:#x})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        if curve:
            # A client without CURVE sees the mismatch first and hangs up, often as here.
            return (
                f"a client hung up during the handshake (errno {value}): a client without "
                "CURVE keys does that, and this worker requires them"
            )
        return f"a client hung up during the handshake (errno {value})"
    return None


class HandshakeWatch:
    """Reads a socket's monitor in a thread and logs refused handshakes; `stop()` at close."""

    def __init__(self, sock: zmq.Socket, curve: bool) -> None:
        """Start monitoring `sock` (before it binds); call from the thread that owns it."""
        self.curve = curve
        self.refusals: dict[str, int] = {}  # per reason: a handful of fixed texts
        self._socket = sock
        self._monitor = sock.get_monitor_socket(WATCHED)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-handshakes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop monitoring and the thread; call before the watched socket closes."""
        # Before the monitor's reading end closes: libzmq's last monitor event is a blocking
        # send, which waits for ever once that end is gone.
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()
        self._stopping.set()
        self._thread.join(timeout=2)
        self._monitor.close(linger=0)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self._monitor.poll(POLL_MS):
                    continue
                event = parse_monitor_message(self._monitor.recv_multipart())
            except zmq.ZMQError:
                return  # the context is terminating
            self.note(int(event["event"]), int(event["value"]))

    def note(self, event: int, value: int) -> None:
        """Count a monitor event; log its refusal the first time, then every so often."""
        why = handshake_refusal(event, value, self.curve)
        if why is None:
            return
        count = self.refusals[why] = self.refusals.get(why, 0) + 1
        if count % REFUSALS_LOGGED_EVERY == 1:
            log.warning("refused a connection's handshake", reason=why, refused=count)
