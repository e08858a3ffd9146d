"""worker/openmp.py: a short OpenMP spin only for workers that share their cores, and never
over a user's own OpenMP settings."""

from __future__ import annotations

from loomserve.worker.openmp import SHARED_CORES_SPIN, spin_environment


def test_workers_that_share_the_cores_get_the_short_spin() -> None:
    assert spin_environment({"PATH": "/bin"}, shared_cores=True) == {
        "GOMP_SPINCOUNT": SHARED_CORES_SPIN
    }
    assert 0 < int(SHARED_CORES_SPIN) < 300_000  # shorter than libgomp's own default


def test_a_worker_with_the_cores_to_itself_keeps_libgomps_default() -> None:
    assert spin_environment({"PATH": "/bin"}, shared_cores=False) == {}


def test_a_users_openmp_settings_are_kept() -> None:
    for setting in ({"GOMP_SPINCOUNT": "INFINITE"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        assert spin_environment(setting, shared_cores=True) == {}
