"""Request classes: a mix of priorities and tenants in one load, reported class by class.

`--class interactive:priority=0,user=alice,share=1 --class batch:priority=5,user=bob,share=3`
sends a quarter of the requests as `interactive` (body fields `priority: 0`, `user: "alice"`)
and three quarters as `batch`, drawn with the run's seed, and reports TTFT and ITL per class.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .datasets import BenchRequest
from .metrics import Distribution, distribution
from .records import RequestRecord


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One kind of request in the mix."""

    name: str
    priority: int | None = None  # sent as the body's `priority` when set
    user: str | None = None  # sent as the body's `user` (the tenant, without API keys)
    share: float = 1.0  # relative frequency in the mix


def parse_class(spec: str) -> RequestClass:
    """NAME:priority=P,user=U,share=S (every field optional) as a RequestClass."""
    name, _, fields = spec.partition(":")
    if not name.strip():
        raise ValueError(f"a request class needs a name: {spec!r}")
    values: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in fields.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in ("priority", "user", "share"):
            raise ValueError(f"bad class field {item!r}: use priority=, user= or share=")
        values[key] = value
    try:
        share = float(values.get("share", 1.0))
        priority = int(values["priority"]) if "priority" in values else None
    except ValueError as exc:
        raise ValueError(f"bad request class {spec!r}: {exc}") from None
    if not share > 0:
        raise ValueError(f"a class's share must be positive: {spec!r}")
    return RequestClass(name.strip(), priority, values.get("user"), share)


def assign_classes(
    requests: Sequence[BenchRequest], classes: Sequence[RequestClass], seed: int
) -> list[BenchRequest]:
    """Each request drawn into a class by the shares; the same seed draws the same mix."""
    if not classes:
        return list(requests)
    rng = random.Random(f"classes-{seed}")
    drawn = rng.choices(classes, weights=[c.share for c in classes], k=len(requests))
    return [
        replace(request, label=c.name, priority=c.priority, user=c.user)
        for request, c in zip(requests, drawn, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class ClassMetrics:
    """TTFT and ITL of one class's successful requests."""

    name: str
    completed: int
    failed: int
    ttft: Distribution
    itl: Distribution


def class_metrics(
    records: Sequence[RequestRecord], classes: Sequence[RequestClass], percentiles: Sequence[float]
) -> list[ClassMetrics]:
    """One ClassMetrics per class, in the order the classes were given."""
    result = []
    for c in classes:
        mine = [r for r in records if r.label == c.name]
        done = [r for r in mine if r.success]
        result.append(
            ClassMetrics(
                name=c.name,
                completed=len(done),
                failed=len(mine) - len(done),
                ttft=distribution([r.ttft_s for r in done if r.ttft_s is not None], percentiles),
                itl=distribution([gap for r in done for gap in r.itl_s], percentiles),
            )
        )
    return result


def format_class_table(rows: Sequence[ClassMetrics]) -> str:
    """One line per class: counts, TTFT and ITL median and p99."""
    header = (
        f"{'class':>16} {'ok':>5} {'fail':>5} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>9} {'ITL p99':>9}"
    )

    def ms(value: float | None) -> str:
        return f"{value:9.1f}" if value is not None else f"{'n/a':>9}"

    lines = [" Per class (ms) ".center(len(header), "="), header]
    for row in rows:
        lines.append(
            f"{row.name:>16} {row.completed:>5} {row.failed:>5} {ms(row.ttft.median_ms)} "
            f"{ms(row.ttft.percentiles_ms.get(99.0))} {ms(row.itl.median_ms)} "
            f"{ms(row.itl.percentiles_ms.get(99.0))}"
        )
    lines.append("=" * len(header))
    return "\n".join(lines)


def class_dict(row: ClassMetrics) -> dict[str, object]:
    """A class's figures for the result JSON, with vLLM-style key names."""
    out: dict[str, object] = {"completed": row.completed, "failed": row.failed}
    for key, dist in (("ttft", row.ttft), ("itl", row.itl)):
        out[f"median_{key}_ms"] = dist.median_ms
        out[f"mean_{key}_ms"] = dist.mean_ms
        for p, value in dist.percentiles_ms.items():
            out[f"p{p:g}_{key}_ms"] = value
    return out
