"""--report FILE.html: one self-contained page a person reads, drawn from the result JSON alone.

Settings, the summary table (with 95 % intervals under --repeats), the sweep or search curve,
latency distributions, throughput and requests in flight over time, per-class tables and the
server's own metrics: inline SVG and CSS, no script and nothing fetched. Each figure of the
summary sits in a cell marked `data-key`, so a test can read it back and match the JSON.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path
from typing import Any

from . import svg
from .search import NOT_COUNTED, stopped_words

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1260px;color:#222;padding:0 1em}
h1{font-size:1.5em}h2{margin-top:2em;border-bottom:1px solid #ddd}h3{margin-bottom:.3em}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:2px 10px;border-bottom:1px solid #eee;
text-align:right}td:first-child,th:first-child{text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:10px}.chart{background:#fafafa;border:1px solid #eee}
.chart text{font-size:11px;fill:#333}.chart .title{font-size:13px;font-weight:600}
.grid{stroke:#e4e4e4}.axis{stroke:#888}.target{stroke:#c44e52;stroke-dasharray:5 4}
.none{fill:#999}.warn{color:#8a5a00;background:#fff6df;padding:4px 8px;margin:4px 0}
.answer{font-size:1.15em;background:#eef5ff;padding:8px 12px}.wide{overflow-x:auto}
"""
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))
SERVER_SERIES = (
    ("waiting", "Requests waiting", "requests"),
    ("running", "Requests running", "requests"),
    ("kv_cache_usage", "KV cache in use", "fraction"),
    ("generation_tokens_per_s", "Server generation tokens/s", "tokens/s"),
    ("prompt_tokens_per_s", "Server prompt tokens/s", "tokens/s"),
)


def fmt(value: Any) -> str:
    """A figure as the report prints it: whole numbers as they are, others to 2 decimals."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return value
    return escape(json.dumps(value) if not isinstance(value, str) else value)


def _table(rows: list[tuple[str, Any, str]], header: tuple[str, ...] = ()) -> str:
    """A two- or three-column table; the key goes in data-key for tests to read back."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        f'<tr><td>{escape(key)}</td><td data-key="{escape(key)}">{fmt(value)}</td>'
        + (f"<td>{extra}</td>" if extra else "")
        + "</tr>"
        for key, value, extra in rows
    )
    return f"<table>{'<tr>' + head + '</tr>' if head else ''}{body}</table>"


def _summary_table(point: dict[str, Any]) -> str:
    figures = point.get("repeats", {}).get("figures", {})
    rows = []
    for key, value in point["summary"].items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items()) or "none"
        extra = ""
        if key in figures:
            low, high = figures[key]["ci95"]
            extra = f"95% CI [{fmt(low)}, {fmt(high)}]"
        rows.append((key, value, extra))
    return _table(rows, ("figure", "value", "interval") if figures else ())


def _distributions(point: dict[str, Any]) -> str:
    charts = []
    for i, (key, name) in enumerate(LATENCIES):
        hist = point.get("distributions", {}).get(key, {})
        charts.append(
            svg.histogram(
                f"{name} distribution",
                "ms",
                hist.get("edges_ms", []),
                hist.get("counts", []),
                svg.PALETTE[i],
            )
        )
    return '<div class="charts">' + "".join(charts) + "</div>"


def _timelines(point: dict[str, Any]) -> str:
    timeline = point.get("timeline", {})
    bucket = timeline.get("bucket_s", 1.0)
    tput = timeline.get("output_tokens_per_s", [])
    flight = timeline.get("in_flight", [])
    charts = [
        svg.line_chart(
            "Output throughput over time",
            "seconds since start",
            "tokens/s",
            [svg.Series("output tok/s", [i * bucket for i in range(len(tput))], tput)],
        ),
        svg.line_chart(
            "Requests in flight over time",
            "seconds since start",
            "requests",
            [svg.Series("in flight", [i * bucket for i in range(len(flight))], flight)],
        ),
    ]
    return '<div class="charts">' + "".join(charts) + "</div>"


def _server_metrics(point: dict[str, Any]) -> str:
    scraped = point.get("server_metrics")
    if not scraped:
        return "<p>Server metrics were not sampled (the target has no /metrics we know).</p>"
    charts = []
    times = scraped.get("times_s", [])
    for key, title, unit in SERVER_SERIES:
        values = scraped.get("series", {}).get(key)
        if values is not None:
            source = scraped["sources"][key]
            charts.append(
                svg.line_chart(
                    f"{title} ({source})",
                    "seconds since start",
                    unit,
                    [svg.Series(key, times, values)],
                    markers=True,
                )
            )
    intro = f"<p>Sampled from a {escape(scraped.get('server', 'unknown'))} server's /metrics.</p>"
    # A counter raised only at each request's end draws lumps, not a pace: said beside it.
    notes = "".join(
        f'<p class="warn">{escape(title)}: {escape(note)}.</p>'
        for key, title, _ in SERVER_SERIES
        if (note := scraped.get("notes", {}).get(key))
    )
    return intro + notes + '<div class="charts">' + "".join(charts) + "</div>"


def _classes(point: dict[str, Any]) -> str:
    classes = point.get("classes")
    if not classes:
        return ""
    keys = list(next(iter(classes.values())))
    head = "<tr><th>class</th>" + "".join(f"<th>{escape(k)}</th>" for k in keys) + "</tr>"
    rows = "".join(
        f"<tr><td>{escape(name)}</td>" + "".join(f"<td>{fmt(row.get(k))}</td>" for k in keys)
        for name, row in classes.items()
    )
    return f"<h3>Per class</h3><table>{head}{rows}</table>"


def _warnings(point: dict[str, Any]) -> str:
    return "".join(f'<div class="warn">{escape(w)}</div>' for w in point.get("warnings", []))


def point_section(point: dict[str, Any], title: str) -> str:
    """Everything about one run (or one point's repeats): summary, curves, server, classes."""
    return (
        f"<section><h2>{escape(title)}</h2>{_warnings(point)}<h3>Summary</h3>"
        f"{_summary_table(point)}{_classes(point)}<h3>Latency distributions</h3>"
        f"{_distributions(point)}<h3>Over time</h3>{_timelines(point)}"
        f"<h3>What the server saw</h3>{_server_metrics(point)}</section>"
    )


def _sweep_section(sweep: dict[str, Any]) -> str:
    parameter, points = sweep["parameter"], sweep["points"]
    tput = [p["summary"]["output_throughput"] for p in points]
    charts = []
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT")):
        charts.append(
            svg.line_chart(
                f"{name} against output throughput (one point per {parameter})",
                "output tokens/s",
                "ms",
                [
                    svg.Series(
                        f"median {name}",
                        tput,
                        [p["summary"].get(f"median_{key}_ms") for p in points],
                    ),
                    svg.Series(
                        f"p99 {name}", tput, [p["summary"].get(f"p99_{key}_ms") for p in points]
                    ),
                ],
                markers=True,
            )
        )
    keys = ("completed", "failed", "request_throughput", "completion_rate", "output_throughput",
            "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")  # fmt: skip
    head = f"<tr><th>{escape(parameter)}</th>" + "".join(f"<th>{k}</th>" for k in keys) + "</tr>"
    rows = "".join(
        f"<tr><td>{_value(p.get('value'))}</td>"
        + "".join(f"<td>{fmt(p['summary'].get(k))}</td>" for k in keys)
        + "</tr>"
        for p in points
    )
    sections = "".join(point_section(p, f"{parameter} = {_value(p.get('value'))}") for p in points)
    return (
        f'<h2>Sweep over {escape(parameter)}</h2><div class="wide"><table class="sweep">{head}'
        f"{rows}</table></div>"
        f'<div class="charts">{"".join(charts)}</div>{sections}'
    )


def _value(value: Any) -> str:
    """A sweep value as the user wrote it: 4, 0.5, inf."""
    return f"{value:g}" if isinstance(value, int | float) else fmt(value)


def _verdict(probe: dict[str, Any]) -> str:
    """A probe's verdict in the console's words: pass, FAIL (with its flaw), or not counted."""
    if not probe.get("complete", True):
        return NOT_COUNTED
    if probe["passed"]:
        return "pass"
    return "FAIL" + (f" ({probe['flaw']})" if probe.get("flaw") else "")


def _search_section(search: dict[str, Any]) -> str:
    probes = [p for p in search["probes"] if p.get("complete", True)]
    cut = [p for p in search["probes"] if not p.get("complete", True)]
    answer = search.get("answer")
    unit = "req/s" if search["mode"] == "max-rate" else "concurrent requests"
    target = search["target_attainment"]
    if answer:
        low, high = answer["attainment_ci95"]
        text = (
            f'Answer: <b data-key="answer">{fmt(answer["value"])}</b> {unit}, attainment '
            f"{answer['attainment']:.1%} (95% CI {low:.1%}-{high:.1%}) against a target of "
            f"{target:.0%}"
        )
    else:
        text = f"No value tried met the target of {target:.0%}."
    if search["stopped"] != "converged":
        text += f" Stopped: {escape(stopped_words(search['stopped']))}."
    ordered = sorted(probes, key=lambda p: p["value"])
    series = [
        svg.Series("attainment", [p["value"] for p in ordered], [p["attainment"] for p in ordered])
    ]
    if cut:  # drawn apart: measured while --duration ran out, they decide nothing
        cut = sorted(cut, key=lambda p: p["value"])
        series.append(
            svg.Series(NOT_COUNTED, [p["value"] for p in cut], [p["attainment"] for p in cut])
        )
    curve = svg.line_chart(
        "Attainment against load",
        unit + (" (log scale)" if search["mode"] == "max-rate" else ""),
        "share within every SLO",
        series,
        markers=True,
        hline=(target, f"target {target:.0%}"),
        log_x=search["mode"] == "max-rate",  # rates double and bisect geometrically
    )
    columns = ("probe", "value", "met", "total", "attainment", "verdict")
    head = "<tr>" + "".join(f"<th>{c}</th>" for c in columns) + "</tr>"
    rows = "".join(
        f"<tr><td>{i + 1}</td><td>{fmt(p['value'])}</td><td>{p['met']}</td><td>{p['total']}</td>"
        f"<td>{p['attainment']:.1%}</td><td>{escape(_verdict(p))}</td></tr>"
        for i, p in enumerate(search["probes"])
    )
    best = next((p for p in probes if answer and p["value"] == answer["value"]), None)
    detail = point_section(best, f"The answer's probe: {fmt(best['value'])} {unit}") if best else ""
    return (
        f'<h2>Search: {escape(search["mode"])}</h2><p class="answer">{text}</p>'
        f'<div class="charts">{curve}</div><table class="probes">{head}{rows}</table>{detail}'
    )


def _settings(result: dict[str, Any]) -> str:
    settings = result.get("settings", {})
    shown = {k: v for k, v in settings.items() if v not in (None, (), [], {})}
    rows = [
        (k, v if not isinstance(v, list | dict) else json.dumps(v), "") for k, v in shown.items()
    ]
    server = result.get("server") or {}
    server_rows = [(k, v if isinstance(v, str) else json.dumps(v), "") for k, v in server.items()]
    return f"<h2>Settings</h2>{_table(rows)}<h3>Server</h3>{_table(server_rows)}"


def render(result: dict[str, Any]) -> str:
    """The whole page for a result dict."""
    settings = result.get("settings", {})
    title = result.get("label") or f"{settings.get('model', '')} at {settings.get('base_url', '')}"
    if "search" in result:
        body = _search_section(result["search"])
    elif "sweep" in result:
        body = _sweep_section(result["sweep"])
    else:
        body = point_section(result, "Run")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>loomserve bench: {escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>loomserve bench: {escape(title)}</h1>"
        f"<p>{escape(str(settings.get('date', '')))}</p>{body}{_settings(result)}</body></html>"
    )


def write_html_report(path: Path, result: dict[str, Any]) -> None:
    """Write the report for result to path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(result), encoding="utf-8")
