"""`loomserve keygen`: CURVE certificates for the worker and its gateways, with zmq.auth.

Each name gets NAME.key (the public key, to hand out) and NAME.key_secret (both keys, to keep).
Certificates already there are kept, so a compose service can run this at every start and
the keys the worker allows stay the keys the gateways hold.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq.auth


def ensure_certificates(directory: Path, names: list[str]) -> list[tuple[Path, bool]]:
    """Each name's secret certificate in directory, and whether it was made now."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    made = []
    for name in names:
        public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
        if public.exists() and secret.exists():
            made.append((secret, False))
            continue
        old_umask = os.umask(0o077)  # the secret is never readable by others, not even briefly
        try:
            zmq.auth.create_certificates(directory, name)
        finally:
            os.umask(old_umask)
        public.chmod(0o644)
        made.append((secret, True))
    return made
