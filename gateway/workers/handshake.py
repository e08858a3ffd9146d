"""What a failed ZeroMQ handshake with a worker means, in words a user can act on.

A socket that connects to the worker (the gateway's DEALER, `loomserve worker-health`'s probe)
watches its monitor events: libzmq reports a handshake that failed, and why as far as it
knows, but nothing else would. Without this a gateway holding the wrong CURVE key says
"not connected" for ever, which is also what a worker that is merely down looks like.
"""

from __future__ import annotations

import zmq

# The monitor events of a handshake that failed; a socket watches these besides its own.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)

_PROTOCOL_ERRORS = {
    int(getattr(zmq, name)): name.removeprefix("PROTOCOL_ERROR_")
    for name in dir(zmq)
    if name.startswith("PROTOCOL_ERROR_")
}


def handshake_failure(event: int, value: int, curve: bool) -> str | None:
    """Why the handshake failed, from a monitor event and its value; None for other events.

    curve: whether this side has CURVE keys (--curve-server-key-file).
    """
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        # The value is the ZAP status code: 400 means the worker's allow-list said no.
        return (
            f"the worker refused this client's CURVE key (ZAP status {value}): the public key "
            "of --curve-secret-key-file is not in the worker's --curve-allowed-keys"
        )
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if curve:
                return (
                    "the worker does not speak CURVE (it runs without --curve-secret-key-file) "
                    "but this client has CURVE keys; configure both sides alike"
                )
            return (
                "the worker requires CURVE: give --curve-server-key-file (the worker's .key) "
                "and --curve-secret-key-file (a .key_secret its allow-list holds)"
            )
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return (
                "the CURVE handshake failed a cryptographic check: --curve-server-key-file is "
                "probably not the worker's public key"
            )
        name = _PROTOCOL_ERRORS.get(value, hex(value))
        return f"the handshake with the worker broke the protocol ({name})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        if curve:
            # The worker cannot decrypt a HELLO made for another server key, and says nothing.
            return (
                "the worker closed the CURVE handshake without a word: --curve-server-key-file "
                "is not that worker's public key (its .key file)"
            )
        return "the handshake with the worker failed (it closed the connection)"
    return None
