"""worker/openmp.py: OpenMP's spin is shortened unless the user set how its threads wait."""

from __future__ import annotations

from loomserve.worker.openmp import SPIN_COUNT, shorten_spin


def test_the_spin_is_shortened_when_nothing_is_set() -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    shorten_spin(environ)
    assert environ == {"PATH": "/bin", "GOMP_SPINCOUNT": SPIN_COUNT}
    assert 0 < int(SPIN_COUNT) < 300_000  # shorter than libgomp's own default


def test_a_users_openmp_settings_are_kept() -> None:
    for setting in ({"GOMP_SPINCOUNT": "INFINITE"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        environ = dict(setting)
        shorten_spin(environ)
        assert environ == setting
