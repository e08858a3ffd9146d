"""worker/openmp.py: passive OpenMP waiting only for workers that share their cores, and never
over a user's own OpenMP settings."""

from __future__ import annotations

from loomserve.worker.openmp import SHARED_CORES_WAIT, wait_environment


def test_workers_that_share_the_cores_wait_passively() -> None:
    assert wait_environment({"PATH": "/bin"}, shared_cores=True) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert SHARED_CORES_WAIT == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_worker_with_the_cores_to_itself_keeps_libgomps_default() -> None:
    assert wait_environment({"PATH": "/bin"}, shared_cores=False) == {}


def test_a_users_openmp_settings_are_kept() -> None:
    for setting in ({"GOMP_SPINCOUNT": "INFINITE"}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        assert wait_environment(setting, shared_cores=True) == {}
