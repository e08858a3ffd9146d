"""The shape of a package, from its source alone (`ast`, no imports): modules and their sizes,
the import graph inside it (arrows, floors, cycles), and what the worker's tick reaches.

    python benchmarks/code_shape.py [--rev GIT_REVISION] [--package worker]

"Reachable from tick()" follows calls by name: from TickLoop.tick, every function or method of
the package whose name a reached body calls (`f(...)` or `x.f(...)`), and a class's __init__
when it is called. Names are not types, so it over-counts where two classes share a method
name; the same rule on two revisions still compares them. docs/architecture.md quotes it.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "gateway", "protocol", "worker")
# Calls too generic to follow by name: containers' and files' methods, not the package's.
GENERIC = {"get", "put", "append", "pop", "clear", "close", "add", "send", "items", "copy"}


@dataclass
class Module:
    name: str  # dotted, inside its package: "sched.scheduler"
    path: str
    tree: ast.Module
    lines: int
    imports: set[str] = field(default_factory=set)  # modules of the same package


def sources(rev: str | None, package: str) -> Iterator[tuple[str, str]]:
    """(path, text) of every .py file under the package folder, at a revision or on disk."""
    if rev is None:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield str(path.relative_to(ROOT)), path.read_text()
        return
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, package],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in sorted(n for n in names if n.endswith(".py")):
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{name}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        yield name, text


def load(rev: str | None, package: str) -> dict[str, Module]:
    modules = {}
    for path, text in sources(rev, package):
        parts = Path(path).with_suffix("").parts[1:]
        if parts[-1] == "__init__":
            continue
        name = ".".join(parts)
        modules[name] = Module(name, path, ast.parse(text), len(text.splitlines()))
    prefix = f"loomserve.{package}."
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith(prefix):
                    target = node.module.removeprefix(prefix)
                    for alias in node.names:  # `from package.sub import module`
                        if f"{target}.{alias.name}" in modules:
                            module.imports.add(f"{target}.{alias.name}")
                    if target in modules:
                        module.imports.add(target)
                elif node.module == prefix.rstrip("."):
                    module.imports.update(a.name for a in node.names if a.name in modules)
        module.imports.discard(module.name)
    return modules


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in modules[name].imports:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == name:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in modules:
        if name not in index:
            visit(name)
    return found


def floors(modules: dict[str, Module]) -> int:
    """Levels of the import graph: 1 + the longest chain of imports (cycles counted once)."""
    depth: dict[str, int] = {}

    def level(name: str, seen: frozenset[str]) -> int:
        if name in depth:
            return depth[name]
        below = [level(o, seen | {name}) for o in modules[name].imports if o not in seen]
        depth[name] = 1 + max(below, default=0)
        return depth[name]

    return max((level(name, frozenset()) for name in modules), default=0)


@dataclass(frozen=True)
class Function:
    module: str
    qualname: str
    lines: int
    node: ast.AST


def functions(modules: dict[str, Module]) -> dict[str, list[Function]]:
    """Every function and method by its simple name; a class's __init__ also by the class's."""
    by_name: dict[str, list[Function]] = {}

    def add(name: str, function: Function) -> None:
        by_name.setdefault(name, []).append(function)

    for module in modules.values():
        for node in module.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                add(node.name, Function(module.name, node.name, _lines(node), node))
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        function = Function(
                            module.name, f"{node.name}.{item.name}", _lines(item), item
                        )
                        add(item.name, function)
                        if item.name == "__init__":
                            add(node.name, function)
    return by_name


def _lines(node: ast.AST) -> int:
    return (node.end_lineno or node.lineno) - node.lineno + 1  # type: ignore[attr-defined]


def reachable(modules: dict[str, Module], start: str) -> tuple[set[Function], int]:
    """The functions reached from `start` ("Class.method"), and the calls among them that
    cross from one module to another."""
    by_name = functions(modules)
    first = next(f for fs in by_name.values() for f in fs if f.qualname == start)
    seen, todo, crossing = {first}, [first], 0
    while todo:
        function = todo.pop()
        for node in ast.walk(function.node):
            if not isinstance(node, ast.Call):
                continue
            callee = node.func
            name = callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", None)
            if name is None or name in GENERIC:
                continue
            for target in by_name.get(name, []):
                crossing += target.module != function.module
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
    return seen, crossing


def largest(rev: str | None) -> tuple[str, int]:
    sizes = [(path, len(text.splitlines())) for p in PACKAGES for path, text in sources(rev, p)]
    return max(sizes, key=lambda item: item[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--rev", help="a git revision (default: the files on disk)")
    parser.add_argument("--package", default="worker", choices=PACKAGES)
    args = parser.parse_args()
    modules = load(args.rev, args.package)
    sizes = sorted(modules.values(), key=lambda m: m.lines)
    print(f"{args.package}/: {len(modules)} modules, {sum(m.lines for m in sizes)} lines")
    print(f"  under 100 lines: {sum(m.lines < 100 for m in sizes)}")
    print(f"  largest: {sizes[-1].path} ({sizes[-1].lines} lines)")
    arrows = sum(len(m.imports) for m in modules.values())
    print(f"  import graph: {arrows} arrows, {floors(modules)} floors")
    print(f"  cycles: {cycles(modules) or 'none'}")
    if args.package == "worker":
        reached, crossing = reachable(modules, "TickLoop.tick")
        files = {f.module for f in reached}
        print(
            f"  reachable from TickLoop.tick: {len(reached)} functions in {len(files)} files,"
            f" {sum(f.lines for f in reached)} lines, {crossing} calls across files"
        )
    path, lines = largest(args.rev)
    print(f"largest module of the four packages: {path} ({lines} lines)")


if __name__ == "__main__":
    main()
