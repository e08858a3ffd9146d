"""The two pages that map the code stay true to it: docs/architecture.md names every Python
module of the four packages (its "Every module" list, by folder), and every file path
docs/life-of-a-request.md names exists. A module added, moved or removed fails here until
the page says so."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "worker", "protocol", "cli")
DOCS = ROOT / "docs"


def modules() -> list[str]:
    """Every tracked Python module of the packages, as `folder/name.py`."""
    listed = subprocess.run(
        ["git", "ls-files", *(f"{package}/*.py" for package in PACKAGES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [name for name in listed if not name.endswith("/__init__.py")]


def listed_modules(text: str) -> set[str]:
    """The modules architecture.md's lines "- `folder/`: `a.py`, `b.py`" name."""
    named = set()
    for line in text.splitlines():
        if match := re.match(r"- `([\w/]+)/`: (.*)", line):
            folder = match.group(1)
            named |= {f"{folder}/{name}" for name in re.findall(r"`([\w]+\.py)`", match[2])}
    return named


def test_architecture_names_every_module() -> None:
    named = listed_modules((DOCS / "architecture.md").read_text())
    missing = sorted(set(modules()) - named)
    assert not missing, f"docs/architecture.md's 'Every module' lacks {missing}"


def test_the_module_list_is_read_as_written() -> None:
    text = "- `worker/io/`: `sockets.py`, `channels.py`\n- `cli/`: `main.py`\nprose `x.py`\n"
    assert listed_modules(text) == {"worker/io/sockets.py", "worker/io/channels.py", "cli/main.py"}


# A path: words and slashes ending in a source file's suffix, inside backticks or bare in the
# diagram. Relative to the repository, or inside one of the packages (the page's sections
# say which: "paths below are inside worker/").
PATH = re.compile(r"(?<![\w./])((?:[\w]+/)*[\w]+\.(?:py|c|h|html))\b")


def named_paths(text: str) -> set[str]:
    return set(PATH.findall(text))


def resolves(path: str) -> bool:
    if (ROOT / path).exists():
        return True
    if "/" in path:
        return any((ROOT / package / path).exists() for package in PACKAGES)
    # A bare name (the diagram's): a module of that name in some package.
    return any(next((ROOT / package).rglob(path), None) for package in PACKAGES)


def test_every_path_life_of_a_request_names_exists() -> None:
    names = named_paths((DOCS / "life-of-a-request.md").read_text())
    assert len(names) > 40  # the page names many; a regex that finds none would pass
    missing = sorted(name for name in names if not resolves(name))
    assert not missing, f"docs/life-of-a-request.md names files that do not exist: {missing}"


def test_a_missing_path_is_found() -> None:
    assert named_paths("see `tick/loop.py` and app.py, not example.com") == {
        "tick/loop.py",
        "app.py",
    }
    assert resolves("tick/loop.py") and resolves("app.py")
    assert not resolves("engine/grammar_state_gone.py") and not resolves("nowhere.py")
