"""CURVE on the worker's ROUTER: the worker's own certificate and an allow-list of gateway keys.

ZeroMQ asks a ZAP handler (zmq.auth's ThreadAuthenticator, a thread of its own) about every
new connection; the handler asks AllowList, and a connection whose key is not on the list is
closed during the handshake, before it can send a frame. Without CURVE anything that reaches
the port is a gateway, which is why WorkerConfig refuses a network bind without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = structlog.get_logger(__name__)

REFUSALS_LOGGED_EVERY = 100  # the first refusal of a key is logged, then every 100th


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """The worker's key pair and the public keys of the gateways it lets in (z85 text)."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]
    allowed_from: Path  # where the allow-list was read, for the log


def load_server_keys(secret_key_file: Path, allowed_keys: Path) -> ServerKeys:
    """The worker's certificate and its allow-list; ValueError when either is unusable."""
    try:
        public, secret = zmq.auth.load_certificate(secret_key_file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the worker's certificate {secret_key_file}: {exc}") from exc
    if secret is None:
        raise ValueError(f"{secret_key_file} holds no secret key: give the .key_secret file")
    return ServerKeys(public, secret, load_allowed_keys(allowed_keys), allowed_keys)


def load_allowed_keys(path: Path) -> frozenset[bytes]:
    """The public keys in one certificate file, or in every *.key file of a directory."""
    try:
        if path.is_dir():
            keys = frozenset(zmq.auth.load_certificates(path))
        else:
            keys = frozenset([zmq.auth.load_certificate(path)[0]])
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the allowed gateway keys {path}: {exc}") from exc
    if not keys:
        raise ValueError(f"{path} holds no public keys (*.key certificate files)")
    return keys


class AllowList:
    """zmq.auth's credentials provider: lets in the listed keys, logs the others."""

    def __init__(self, keys: ServerKeys) -> None:
        self.keys = keys
        self.refused: dict[bytes, int] = {}  # per key, bounded by what the log needs

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys.allowed:
            return True
        if len(self.refused) >= 1000:  # a flood of fresh keys must not grow this
            self.refused.clear()
        count = self.refused[key] = self.refused.get(key, 0) + 1
        if count % REFUSALS_LOGGED_EVERY == 1:
            log.warning(
                "refused a connection: its CURVE key is not in the allow-list",
                key=key.decode(errors="replace"),
                allowed_keys=str(self.keys.allowed_from),
                refused=count,
            )
        return False


def make_curve_server(
    context: zmq.Context, sock: zmq.Socket, keys: ServerKeys
) -> ThreadAuthenticator:
    """Start the ZAP handler and make sock a CURVE server; call before sock binds."""
    auth = ThreadAuthenticator(context, log=logging.getLogger("loomserve.worker.zap"))
    auth.start()
    auth.configure_curve_callback("*", AllowList(keys))
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    return auth
