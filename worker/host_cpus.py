"""How many CPUs this worker may use: the fewest of its affinity mask and its cgroup's CPU quota.

`os.sched_getaffinity` sees cpusets and taskset, but not a CPU quota: a Kubernetes CPU limit
(or `docker run --cpus`) is a CFS quota, a number of microseconds per period the cgroup's
threads may run in all. A pod limited to 2 CPUs on a 64-core node sees 64 cores in its mask;
64 llama.cpp threads there use up the quota early in each 100 ms period and are all stopped
until the next, and a thread stopped halfway through a forward pass holds up the others at
each of its barriers. So the default thread count is the quota (rounded up, at least 1)
where it is below the mask.

cgroup v2 keeps the quota in `cpu.max` ("200000 100000": 2 CPUs; "max 100000": none), v1 in
`cpu.cfs_quota_us` (-1: none) and `cpu.cfs_period_us`. A limit set on a parent cgroup binds
the child too, so every level from this process's cgroup up to the mount is read and the
smallest quota wins.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# Where cgroup v1 mounts the cpu controller, by distribution.
V1_CPU_MOUNTS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")

AFFINITY = "affinity"
V2_QUOTA = "cgroup v2 quota"
V1_QUOTA = "cgroup v1 quota"
OPTION = "option"


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """A number of CPUs (or threads) and where it came from, for the start-up log."""

    count: int
    source: str  # AFFINITY, V2_QUOTA, V1_QUOTA or OPTION


def affinity_cpus() -> int:
    """The CPUs this process may run on (cpusets, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_budget(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP, affinity: int | None = None
) -> CpuBudget:
    """The CPUs this process may keep busy: the affinity mask, or the cgroup's CPU quota
    where that is smaller. `root` is where cgroups are mounted; `proc_cgroup` lists this
    process's cgroups (both fakes in tests)."""
    mask = affinity if affinity is not None else affinity_cpus()
    best = CpuBudget(max(1, mask), AFFINITY)
    for source, quota in _quotas(root, _cgroup_paths(proc_cgroup)):
        if quota < best.count:
            best = CpuBudget(quota, source)
    return best


@cache
def default_cpu_budget() -> CpuBudget:
    """cpu_budget() of this machine, read once: the worker's thread count must not change."""
    return cpu_budget()


def thread_budget(threads: int) -> CpuBudget:
    """The llama.cpp threads of a worker given --threads `threads` (0: the CPUs it may use)."""
    if threads:
        return CpuBudget(threads, OPTION)
    return default_cpu_budget()


def quota_cpus(quota_us: int, period_us: int) -> int:
    """A quota of `quota_us` per `period_us` as whole CPUs: rounded up (1.5 CPUs keep 2
    threads busy part of the time), at least 1."""
    return max(1, math.ceil(quota_us / period_us))


def _cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """This process's cgroup path in the v2 hierarchy ("v2") and the v1 cpu one ("v1")."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return {}
    paths: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)  # hierarchy-ID:controllers:path
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths["v2"] = path
        elif "cpu" in controllers.split(","):
            paths["v1"] = path
    return paths


def _levels(mount: Path, path: str) -> list[Path]:
    """The mount's directory for `path` and each of its parents up to the mount itself. In a
    container with its own cgroup namespace the mount is the container's cgroup already, and
    a path from outside it may not exist: then the mount alone."""
    here = mount / path.lstrip("/")
    if not here.is_dir():
        return [mount]
    levels = [here]
    while here != mount and mount in here.parents:
        here = here.parent
        levels.append(here)
    return levels


def _quotas(root: Path, paths: dict[str, str]) -> list[tuple[str, int]]:
    """Each quota set on this process's cgroups, in CPUs, with its source."""
    found = []
    for level in _levels(root, paths.get("v2", "/")):
        quota = _v2_quota(level / "cpu.max")
        if quota is not None:
            found.append((V2_QUOTA, quota))
    for name in V1_CPU_MOUNTS:
        mount = root / name
        if not mount.is_dir():
            continue
        for level in _levels(mount, paths.get("v1", "/")):
            quota = _v1_quota(level / "cpu.cfs_quota_us", level / "cpu.cfs_period_us")
            if quota is not None:
                found.append((V1_QUOTA, quota))
        break  # the other names are links to the same mount
    return found


def _v2_quota(path: Path) -> int | None:
    try:
        words = path.read_text().split()
    except OSError:
        return None
    if len(words) != 2 or not words[0].isdigit() or not words[1].isdigit():
        return None  # "max 100000": no quota at this level
    return quota_cpus(int(words[0]), int(words[1]))


def _v1_quota(quota_path: Path, period_path: Path) -> int | None:
    try:
        quota = int(quota_path.read_text())
        period = int(period_path.read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None  # -1: no quota at this level
    return quota_cpus(quota, period)
