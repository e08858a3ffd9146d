"""The processes /proc lists, for the benchmarks that watch a server's processes (their tree,
their CPU time): one reader of /proc/PID/stat and cmdline instead of one per benchmark."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")  # /proc/PID/stat counts CPU time in these


@dataclass(frozen=True, slots=True)
class Process:
    pid: int
    parent: int
    command: list[str]  # argv, decoded
    user_s: float  # CPU seconds so far (utime)
    system_s: float  # (stime)


def processes() -> list[Process]:
    """Every process now; one that exits while it is read is left out."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        # The fields after the command's name, which may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        command = [part.decode(errors="replace") for part in cmdline.split(b"\0") if part]
        found.append(
            Process(
                int(entry),
                int(fields[1]),
                command,
                int(fields[11]) / TICKS,
                int(fields[12]) / TICKS,
            )
        )
    return found
