"""The RAM prompt cache's default budget: 8192 MiB as llama-server's, within the memory the
worker may use."""

from __future__ import annotations

from pathlib import Path

from loomserve.worker.config import DEFAULT_CACHE_RAM_MIB, MIB, WorkerConfig
from loomserve.worker.host_memory import memory_limit_bytes, physical_memory_bytes

GIB = 1024**3


def test_a_cgroup_limit_below_the_ram_is_the_limit(tmp_path: Path):
    limit = tmp_path / "memory.max"
    limit.write_text(f"{2 * GIB}\n")
    assert memory_limit_bytes((limit,)) == min(2 * GIB, physical_memory_bytes())


def test_no_cgroup_limit_means_the_machines_ram(tmp_path: Path):
    unlimited = tmp_path / "memory.max"
    unlimited.write_text("max\n")
    missing = tmp_path / "absent"
    assert memory_limit_bytes((unlimited,)) == physical_memory_bytes()
    assert memory_limit_bytes((missing,)) == physical_memory_bytes()
    # The first file that exists decides (cgroup v2 before v1).
    v1 = tmp_path / "memory.limit_in_bytes"
    v1.write_text(str(GIB))
    assert memory_limit_bytes((missing, v1)) == min(GIB, physical_memory_bytes())


def test_the_default_budget_is_8_gib_at_most_a_quarter_of_the_limit(tmp_path: Path):
    config = WorkerConfig(model_path=tmp_path / "m.gguf")
    expected = min(DEFAULT_CACHE_RAM_MIB * MIB, memory_limit_bytes() // 4)
    assert config.ram_cache_bytes == expected > 0
    assert WorkerConfig(model_path=tmp_path / "m.gguf", cache_ram=0).ram_cache_bytes == 0
    assert WorkerConfig(model_path=tmp_path / "m.gguf", cache_ram=64).ram_cache_bytes == 64 * MIB


def test_a_cache_ram_beyond_the_machine_is_clamped_to_it(tmp_path: Path):
    # --cache-ram 10000000 (10 TB) once became a 10 TB budget, spent until the OOM killer came.
    huge = WorkerConfig(model_path=tmp_path / "m.gguf", cache_ram=10_000_000)
    assert huge.ram_cache_bytes == memory_limit_bytes() and huge.cache_ram_clamped
    small = WorkerConfig(model_path=tmp_path / "m.gguf", cache_ram=64)
    assert not small.cache_ram_clamped
    assert not WorkerConfig(model_path=tmp_path / "m.gguf").cache_ram_clamped
