"""`loomserve keygen`: CURVE certificates for the worker and its gateways, with zmq.auth.

Each name gets NAME.key (the public key, to hand out) and NAME.key_secret (both keys, to keep).
Certificates already there are kept, so a compose service can run this at every start and
the keys the worker allows stay the keys the gateways hold.

Split (`--split`), each name gets a folder of its own: DIRECTORY/NAME/ holds NAME's secret
certificate and every other name's public key, so a service that mounts its own folder
(compose's gateways) can never read another's secret key (the worker's).
"""

from __future__ import annotations

import os
import shutil
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


def ensure_split_certificates(directory: Path, names: list[str]) -> list[tuple[Path, bool]]:
    """Each name's secret certificate in directory/NAME/, with the others' public keys."""
    made = [ensure_certificates(directory / name, [name])[0] for name in names]
    for name in names:
        public = directory / name / f"{name}.key"
        for other in names:
            if other != name:
                copy = directory / other / public.name
                shutil.copyfile(public, copy)  # kept in step with a certificate made anew
                copy.chmod(0o644)
    return made
