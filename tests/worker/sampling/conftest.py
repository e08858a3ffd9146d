"""The sampling tests' instruction sets: `isa` runs a test once for each one this CPU has
(AVX-512, AVX2, and always plain C), the C library limited to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from loomserve.worker.sampling import rowscan


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


LEVELS = [level for level, flag in ((2, "avx512f"), (1, "avx2")) if flag in _cpu_flags()] + [0]


@pytest.fixture(params=LEVELS, ids=lambda level: ["plain C", "AVX2", "AVX-512"][level])
def isa(request):
    """The C library limited to one instruction set (0: its plain C, for a CPU with neither,
    a row's last partial block and elsewhere), restored afterwards."""
    library = rowscan.library()
    assert library is not None
    library.ls_limit_isa(request.param)
    assert library.ls_isa() == request.param
    yield request.param
    library.ls_limit_isa(2)
