"""How much memory this worker may use: its cgroup's limit (a container's, a pod's), else the
machine's RAM. The RAM prompt cache's default budget is a share of it (config.py), so that a
default worker never outgrows the container it runs in."""

from __future__ import annotations

import os
from pathlib import Path

# cgroup v2, then v1; "max" (v2) or a huge number (v1) means no limit.
CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit_bytes(cgroup_files: tuple[Path, ...] = CGROUP_LIMITS) -> int:
    """The smaller of the machine's RAM and the cgroup's memory limit, if it has one."""
    physical = physical_memory_bytes()
    for path in cgroup_files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(physical, int(text))
        return physical  # "max": no limit at this level
    return physical
