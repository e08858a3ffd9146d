"""CURVE for a socket that connects to the worker: the gateway's DEALER, the health probe.

Both key files are zmq.auth certificates (`loomserve keygen` writes them): the worker's public
one, and this client's own secret one, whose public key must be in the worker's allow-list.
"""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.auth


def set_curve_client(sock: zmq.Socket, server_key_file: Path, secret_key_file: Path) -> None:
    """Make sock a CURVE client of the worker; call before it connects. ValueError when a
    certificate is unusable."""
    try:
        server_public, _ = zmq.auth.load_certificate(server_key_file)
        public, secret = zmq.auth.load_certificate(secret_key_file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a CURVE certificate: {exc}") from exc
    if secret is None:
        raise ValueError(f"{secret_key_file} holds no secret key: give the .key_secret file")
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret
