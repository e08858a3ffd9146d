"""--sweep: run the same prompts at several concurrency levels, rates or burstiness values."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .runner import LoadShape

SWEEPABLE = {
    "max-concurrency": "max_concurrency",
    "request-rate": "request_rate",
    "burstiness": "burstiness",
}


def parse_sweep(spec: str) -> tuple[str, list[float]]:
    """("max-concurrency", [1, 4, 16]) from "max-concurrency=1,4,16"."""
    name, sep, values = spec.partition("=")
    name = name.strip().lstrip("-").replace("_", "-")
    if not sep or name not in SWEEPABLE:
        raise ValueError(f"bad --sweep {spec!r}: expected one of {sorted(SWEEPABLE)}=V1,V2,...")
    try:
        parsed = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"bad --sweep {spec!r}: values must be numbers (or inf)") from None
    if not parsed:
        raise ValueError(f"bad --sweep {spec!r}: no values")
    if any(v <= 0 or math.isnan(v) for v in parsed):
        raise ValueError(f"bad --sweep {spec!r}: values must be positive")
    if name == "max-concurrency" and any(not (v.is_integer() and math.isfinite(v)) for v in parsed):
        raise ValueError(f"bad --sweep {spec!r}: concurrency levels must be whole numbers")
    return name, parsed


def _change(field: str, value: float) -> dict[str, Any]:
    """The replacement for one field of LoadShape (whose fields are of several types)."""
    return {field: int(value) if field == "max_concurrency" else value}


def sweep_shapes(base: LoadShape, parameter: str, values: list[float]) -> list[LoadShape]:
    """The base load shape with one parameter replaced by each value in turn."""
    field = SWEEPABLE[parameter]
    return [dataclasses.replace(base, **_change(field, v)) for v in values]
