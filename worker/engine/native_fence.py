"""Whether the worker's native code may reach into llama.cpp's graph on this install.

graphdraw.c (the draw inside llama_decode) and q0swap.c (loomserve's matmul kernels swapped
into ggml's graph) write and read ggml's tensors and llama.cpp's sampler interface through
copies of their declarations (ggml_abi.h, graphdraw.c). Those copies are right for the
llama.cpp they were written against and silently wrong for another: llama-cpp-python 0.3.30,
inside pyproject.toml's range, has a tensor of the same size but other operation numbers and a
sampler interface with one argument fewer, and served wrong tokens with every default on.

So the hooks run only where both hold:
- the install is one this project has verified (VERIFIED: the llama-cpp-python version and
  the ggml version it vendors, the pair CI runs the whole suite with), and
- the probe agrees: abiprobe.c finds every field and operation number the C code touches
  through ggml's own public calls, and llama-cpp-python's binding declares the sampler
  interface and its data as graphdraw.c does.

Anywhere else the worker samples on the host and multiplies with ggml's own kernels: the same
tokens, a little slower; one warning says why, and the start-up line shows it.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import llama_cpp as llama

# (llama-cpp-python, the ggml it vendors) pairs whose graph hooks this project has checked:
# CI runs the whole suite, the kernels' bit-for-bit tests and batch invariance on them.
VERIFIED: frozenset[tuple[str, str]] = frozenset({("0.3.36", "0.25.3")})

# abiprobe.c's facts, in its order (F_OBJECT_BYTES ...).
FACTS = (
    "object bytes",
    "tensor bytes",
    "type offset",
    "buffer offset",
    "ne offset",
    "nb offset",
    "op offset",
    "op_params offset",
    "src offset",
    "src length",
    "view_src offset",
    "view_offs offset",
    "data offset",
    "name offset",
    "name length",
    "extra offset",
    "GGML_OP_MUL_MAT",
    "GGML_OP_CUSTOM",
    "custom op n_tasks offset",
    "custom op userdata offset",
    "type numbers",
    "CPU buffer is host",
)

# llama.cpp's sampler interface as graphdraw.c declares it: each member and its arguments.
SAMPLER_INTERFACE = (
    ("name", 1),
    ("accept", 2),
    ("apply", 2),
    ("reset", 1),
    ("clone", 1),
    ("free", 1),
    ("backend_init", 3),
    ("backend_accept", 4),
    ("backend_apply", 4),
    ("backend_set_input", 1),
    ("backend_reset", 1),
    ("copy_state", 2),
)
SAMPLER_DATA = ("logits", "probs", "sampled", "candidates")


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether the graph hooks may run, and why not where they may not."""

    allowed: bool
    install: str  # "llama-cpp-python 0.3.36, ggml 0.25.3"
    reason: str = ""


def ggml_library(name: str) -> Path:
    """One of the ggml libraries llama-cpp-python ships (and llama.cpp has loaded)."""
    return Path(llama.__file__).parent / "lib" / name


def installed_versions() -> tuple[str, str]:
    """llama-cpp-python's version and the ggml version its libraries report."""
    try:
        package = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        package = getattr(llama, "__version__", "unknown")
    ggml = "unknown"
    path = ggml_library("libggml-base.so")
    if path.exists():
        base = ctypes.CDLL(str(path))
        if hasattr(base, "ggml_version"):
            base.ggml_version.restype = ctypes.c_char_p
            ggml = base.ggml_version().decode()
    return package, ggml


def layout_differences(lib: Any, declared: dict[str, int] | None = None) -> list[str]:
    """The facts where ggml's tensor, found by abiprobe.c, differs from what the C code
    declares (`declared`: abiprobe.c's ls_abi_declared unless given)."""
    base = ggml_library("libggml-base.so")
    found = (ctypes.c_int64 * len(FACTS))()
    if not base.exists() or lib.ls_abi_probe(str(base).encode(), found) != len(FACTS):
        return ["ggml's public calls the probe needs"]
    if declared is None:
        values = (ctypes.c_int64 * len(FACTS))()
        lib.ls_abi_declared(values)
        declared = dict(zip(FACTS, values, strict=True))
    return [
        f"{fact} (ggml: {value}, loomserve: {declared[fact]})"
        for fact, value in zip(FACTS, found, strict=True)
        if value != declared[fact]
    ]


def interface_differences() -> list[str]:
    """Where llama-cpp-python's binding of the sampler interface and its data differs from
    graphdraw.c's declaration (the binding is written from the llama.h it vendors)."""
    iface = getattr(llama, "llama_sampler_i", None)
    data = getattr(llama, "llama_sampler_data", None)
    if iface is None or data is None:
        return ["llama.cpp's backend sampler interface"]
    members = [(name, len(kind._argtypes_)) for name, kind in iface._fields_]
    differences = []
    if members != list(SAMPLER_INTERFACE):
        differences.append(f"llama_sampler_i {members}")
    if [name for name, _ in data._fields_] != list(SAMPLER_DATA):
        differences.append(f"llama_sampler_data {[name for name, _ in data._fields_]}")
    return differences


def judge(lib: Any, verified: frozenset[tuple[str, str]] = VERIFIED) -> Verdict:
    """Whether graphdraw.c and q0swap.c may run with this llama.cpp."""
    package, ggml = installed_versions()
    install = f"llama-cpp-python {package}, ggml {ggml}"
    differences = interface_differences() + layout_differences(lib)
    if differences:
        return Verdict(False, install, "its layout differs: " + "; ".join(differences))
    if (package, ggml) not in verified:
        listed = ", ".join(f"{p} (ggml {g})" for p, g in sorted(verified))
        return Verdict(False, install, f"not a verified install (verified: {listed})")
    return Verdict(True, install)


@functools.cache
def verdict(lib: Any) -> Verdict:
    """judge(), once a process."""
    return judge(lib)
