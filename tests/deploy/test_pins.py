"""requirements/test.txt pins everything pyproject.toml asks for, so the README's test command
installs exactly what the suite was last run with (refresh: see the README)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def pinned() -> dict[str, list[Version]]:
    """Each package name in the compiled file with its pinned versions (one per marker)."""
    pins: dict[str, list[Version]] = {}
    for line in (ROOT / "requirements" / "test.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        if match:
            name = re.sub(r"[-_.]+", "-", match[1]).lower()
            pins.setdefault(name, []).append(Version(match[2]))
    return pins


def asked_for() -> list[Requirement]:
    """The runtime dependencies and the test and dev extras (not loomserve's own extras)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [
        line
        for extra in ("test", "dev", "bench")
        for line in project["optional-dependencies"][extra]
        if not line.startswith("loomserve")
    ]
    return [Requirement(line) for line in lines]


def test_every_requirement_is_pinned_within_its_range() -> None:
    pins = pinned()
    for requirement in asked_for():
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert name in pins, f"{requirement.name} is not in requirements/test.txt"
        for version in pins[name]:
            assert requirement.specifier.contains(version, prereleases=True), (
                f"{name}=={version} is outside pyproject's {requirement}: refresh the pins"
            )


def test_ci_and_readme_install_with_the_pins() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "-c requirements/test.txt" in ci
    assert "pip install -c requirements/test.txt '.[test]' && pytest" in readme
    assert "uv pip compile pyproject.toml" in readme
