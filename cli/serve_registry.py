"""Where a running `serve` says what it runs, so that other commands can find its workers.

serve's workers listen on ipc:// sockets in a private temp dir whose name is random; without
this file an operator finds them only in serve's log or in /slots. Each serve writes one
JSON record (its pid, URL and each model's worker endpoints) into the runtime dir while it
runs and removes it on the way out; `loomserve workers` lists the records and
`loomserve worker-health` without --worker probes their workers. A record whose serve died
without removing it (SIGKILL) is skipped: its pid no longer runs.

The runtime dir: $LOOMSERVE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/loomserve, else
<tmp>/loomserve-<uid>; private to the user (0700), as serve's own temp dir is.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ServeRecord:
    """One running serve: where it answers, and each model's worker endpoints."""

    pid: int
    url: str
    models: Mapping[str, list[str]]  # model name -> its workers' endpoints
    # Several models (a model manager): a model's workers run only while it is loaded.
    on_demand: bool = False
    path: Path = field(default=Path(), compare=False)  # the record's file

    def endpoints(self) -> list[str]:
        return [endpoint for own in self.models.values() for endpoint in own]


def runtime_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The directory of the records (the module's docstring says which)."""
    if own := environ.get("LOOMSERVE_RUNTIME_DIR"):
        return Path(own)
    if xdg := environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "loomserve"
    return Path(tempfile.gettempdir()) / f"loomserve-{os.getuid()}"


@contextlib.contextmanager
def registered(record: ServeRecord, directory: Path | None = None) -> Iterator[Path]:
    """Write record for the block's length (serve's run); its file, removed at the end."""
    directory = directory or runtime_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"serve-{record.pid}.json"
    body = {
        "pid": record.pid,
        "url": record.url,
        "models": dict(record.models),
        "on_demand": record.on_demand,
    }
    # Written whole then renamed: a reader never sees half a record.
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(body, indent=1) + "\n")
    partial.replace(path)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def running(directory: Path | None = None) -> list[ServeRecord]:
    """The records of the serves still running, oldest pid first."""
    directory = directory or runtime_dir()
    records = []
    for path in sorted(directory.glob("serve-*.json")):
        try:
            body = json.loads(path.read_text())
            record = ServeRecord(
                pid=int(body["pid"]),
                url=str(body["url"]),
                models={str(k): [str(e) for e in v] for k, v in body["models"].items()},
                on_demand=bool(body.get("on_demand", False)),
                path=path,
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # being written, or not ours
        if _alive(record.pid):
            records.append(record)
    return sorted(records, key=lambda r: r.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # runs, as another user
    return True
