"""worker/host_cpus.py: the default thread count follows the cgroup's CPU quota (v2 cpu.max,
v1 cfs_quota_us/cfs_period_us) as well as the affinity mask, on fake cgroup trees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loomserve.worker.config import WorkerConfig
from loomserve.worker.host_cpus import (
    AFFINITY,
    OPTION,
    V1_QUOTA,
    V2_QUOTA,
    CpuBudget,
    affinity_cpus,
    cpu_budget,
    quota_cpus,
    thread_budget,
)
from tests.procs import start_worker


def v2_tree(tmp_path: Path, cpu_max: str, path: str = "/") -> tuple[Path, Path]:
    """A cgroup v2 mount whose cgroup `path` has `cpu.max`, and a /proc/self/cgroup naming it."""
    root = tmp_path / "cgroup"
    cgroup = root / path.lstrip("/")
    cgroup.mkdir(parents=True, exist_ok=True)
    (cgroup / "cpu.max").write_text(cpu_max + "\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


def test_a_v2_quota_of_two_cpus_gives_two_threads(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path, "200000 100000")
    assert cpu_budget(root, proc, affinity=64) == CpuBudget(2, V2_QUOTA)


def test_no_v2_quota_falls_back_to_the_affinity_mask(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path, "max 100000")
    assert cpu_budget(root, proc, affinity=6) == CpuBudget(6, AFFINITY)
    # No cgroup files at all (not Linux, or not mounted): the mask too.
    assert cpu_budget(tmp_path / "absent", tmp_path / "absent", affinity=3) == CpuBudget(
        3, AFFINITY
    )
    # And the real default: the mask of this process where nothing limits it further.
    assert cpu_budget(tmp_path / "absent", tmp_path / "absent") == CpuBudget(
        affinity_cpus(), AFFINITY
    )


def test_the_mask_wins_where_it_is_smaller_than_the_quota(tmp_path: Path) -> None:
    root, proc = v2_tree(tmp_path, "800000 100000")
    assert cpu_budget(root, proc, affinity=2) == CpuBudget(2, AFFINITY)


def test_a_fraction_of_a_cpu_is_rounded_up_and_never_below_one() -> None:
    assert quota_cpus(150_000, 100_000) == 2
    assert quota_cpus(50_000, 100_000) == 1
    assert quota_cpus(1_000, 100_000) == 1
    assert quota_cpus(400_000, 100_000) == 4


def test_a_parents_quota_binds_the_child(tmp_path: Path) -> None:
    # The pod's cgroup has the limit; the container's, below it, has none of its own.
    root, proc = v2_tree(tmp_path, "max 100000", path="/kubepods/pod1/container")
    (root / "kubepods/pod1/cpu.max").write_text("300000 100000\n")
    (root / "kubepods/cpu.max").write_text("max 100000\n")
    assert cpu_budget(root, proc, affinity=64) == CpuBudget(3, V2_QUOTA)


def test_a_path_from_outside_the_cgroup_namespace_reads_the_mount(tmp_path: Path) -> None:
    # In a container with its own cgroup namespace, /sys/fs/cgroup is its own cgroup already.
    root, _ = v2_tree(tmp_path, "100000 100000")
    proc = tmp_path / "elsewhere"
    proc.write_text("0::/not/mounted/here\n")
    assert cpu_budget(root, proc, affinity=8) == CpuBudget(1, V2_QUOTA)


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_a_v1_quota_is_read_too(tmp_path: Path, mount: str) -> None:
    root = tmp_path / "cgroup"
    cgroup = root / mount / "docker/abc"
    cgroup.mkdir(parents=True)
    (cgroup / "cpu.cfs_quota_us").write_text("250000\n")
    (cgroup / "cpu.cfs_period_us").write_text("100000\n")
    (root / mount / "cpu.cfs_quota_us").write_text("-1\n")  # the root: no quota
    (root / mount / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cpu_budget(root, proc, affinity=16) == CpuBudget(3, V1_QUOTA)
    (cgroup / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_budget(root, proc, affinity=16) == CpuBudget(16, AFFINITY)


def test_the_option_wins_and_says_so() -> None:
    assert thread_budget(5) == CpuBudget(5, OPTION)
    config = WorkerConfig(model_path=Path("m.gguf"), threads=3)
    assert (config.n_threads, config.thread_budget.source) == (3, OPTION)
    default = WorkerConfig(model_path=Path("m.gguf"))
    assert default.n_threads == default.thread_budget.count >= 1
    assert default.thread_budget.source in (AFFINITY, V2_QUOTA, V1_QUOTA)


def test_the_start_up_line_says_where_the_threads_came_from(tiny_model_path: Path) -> None:
    """A real worker's `model loaded` line: the threads and their source, mask or quota by
    default, the option when given."""
    for threads, sources in ((0, (AFFINITY, V2_QUOTA, V1_QUOTA)), (1, (OPTION,))):
        with start_worker(tiny_model_path, threads=threads, log_json=True) as worker:
            loaded = next(
                json.loads(line)
                for line in worker.logs().splitlines()
                if '"event": "model loaded"' in line
            )
        assert loaded["threads_from"] in sources
        assert loaded["threads"] == (threads or thread_budget(0).count)
