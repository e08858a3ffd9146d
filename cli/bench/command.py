"""`loomserve bench`: the load generator's command line.

Also `python -m loomserve.cli.bench.command`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from .classes import parse_class
from .compare import compare, format_comparison
from .metrics import parse_slos
from .probe import BenchSetupError
from .report import write_json
from .runner import LoadShape, WarmupFailed
from .session import DATASETS, BenchConfig, run_session
from .sweep import parse_sweep


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = sorted({float(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of numbers") from None
    if not all(0 < p < 100 for p in values):
        raise click.BadParameter("percentiles must lie between 0 and 100")
    return tuple(values)


def _warn(message: str) -> None:
    click.secho(f"warning: {message}", fg="yellow", err=True)


@click.group(
    context_settings={"show_default": True},
    invoke_without_command=True,
    subcommand_metavar="[compare A.json B.json]",
)
@click.option("--base-url", default="http://127.0.0.1:8000", help="The server's root URL.")
@click.option("--model", default=None, help="Model name. Default: the first of /v1/models.")
@click.option(
    "--endpoint",
    type=click.Choice(["completions", "chat"]),
    default="completions",
    help="/v1/completions or /v1/chat/completions.",
)
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="Bearer token to send.")
@click.option("--dataset", type=click.Choice(DATASETS), default="random", help="Prompt source.")
@click.option(
    "--dataset-path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="ShareGPT JSON (implied when no --dataset is given), a Mooncake-style trace "
    "(--dataset trace) or JSONL prompts (--dataset jsonl), e.g. --dataset trace "
    "--dataset-path mooncake.jsonl --time-scale 0.5, or --dataset jsonl --dataset-path "
    'prompts.jsonl (lines {"prompt": ...} or {"messages": [...]}).',
)
@click.option(
    "--time-scale",
    type=float,
    default=1.0,
    help="trace: a request is due at its timestamp x this (0.5 replays twice as fast).",
)
@click.option(
    "--trace-block-size",
    type=int,
    default=512,
    help="trace: prompt tokens each hash id stands for (Mooncake's traces use 512).",
)
@click.option("--num-prompts", type=int, default=100, help="Requests per run.")
@click.option(
    "--input-len",
    type=int,
    default=256,
    help="Prompt tokens (random, shared-prefix); the passage's (input-grounded).",
)
@click.option(
    "--output-len",
    type=int,
    default=None,
    help="Output tokens (max_tokens). Default: 128, each ShareGPT answer's length, or the "
    "input-grounded passage's.",
)
@click.option(
    "--range-ratio",
    type=float,
    default=0.0,
    help="Spread lengths uniformly over [len·(1−r), len·(1+r)].",
)
@click.option("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens.")
@click.option("--num-groups", type=int, default=4, help="shared-prefix: distinct system prompts.")
@click.option(
    "--turns",
    type=int,
    default=4,
    help="multi-turn: turns per conversation; --num-prompts conversations, each with a "
    "--prefix-len system prompt and --input-len user messages, sending its whole history.",
)
@click.option(
    "--request-rate",
    type=float,
    default=math.inf,
    help="Requests/s with Poisson arrivals; inf sends all at once.",
)
@click.option(
    "--burstiness",
    type=float,
    default=1.0,
    help="Gamma shape of the arrival gaps: 1 is Poisson, <1 burstier, >1 more even.",
)
@click.option(
    "--max-concurrency",
    type=int,
    default=None,
    help="Requests in flight at most (a closed loop when the rate is inf).",
)
@click.option("--num-warmups", type=int, default=1, help="Unmeasured requests sent first.")
@click.option(
    "--duration",
    type=float,
    default=3600.0,
    help="Hard bound on each run, seconds: requests still running are cut off.",
)
@click.option("--timeout", type=float, default=600.0, help="Per-request limit, seconds.")
@click.option("--seed", type=int, default=0, help="Seed for prompts and arrival times.")
@click.option(
    "--ignore-eos/--no-ignore-eos",
    default=True,
    help="Ask the server to generate exactly max_tokens (comparable runs).",
)
@click.option("--temperature", type=float, default=0.0, help="Sampling temperature.")
@click.option(
    "--tokenize/--no-tokenize",
    default=True,
    help="Size prompts with the server's /tokenize when it has one; else estimate.",
)
@click.option(
    "--goodput",
    multiple=True,
    help='SLOs in ms, e.g. --goodput "ttft:500 tpot:50" (also e2el:MS); repeatable.',
)
@click.option("--percentiles", default="90,99", help="Percentiles to report, comma-separated.")
@click.option("--extra-body", default=None, help="JSON object merged into every request body.")
@click.option(
    "--class",
    "classes",
    multiple=True,
    help="A request class: NAME:priority=P,user=U,share=S (repeatable). Requests are drawn "
    "into classes by share and send their priority and user; TTFT and ITL are reported "
    "per class.",
)
@click.option(
    "--sweep",
    default=None,
    help="Run once per value: max-concurrency=1,4,16 or request-rate=1,2,4 (or burstiness=).",
)
@click.option(
    "--find",
    type=click.Choice(["max-rate", "max-concurrency"]),
    default=None,
    help="Search the most load that meets the SLOs, e.g. --find max-rate --goodput "
    '"ttft:500 tpot:50" --attainment 90: bracket, bisect, print each probe; --duration '
    "bounds the whole search.",
)
@click.option(
    "--attainment",
    type=float,
    default=90.0,
    help="--find: percent of requests (failed ones count) that must meet every SLO.",
)
@click.option(
    "--find-precision",
    type=float,
    default=0.1,
    help="--find: stop when the bracket is this narrow (relative; one step for concurrency).",
)
@click.option(
    "--repeats",
    type=int,
    default=1,
    help="Run each point N times; report means with 95% intervals, e.g. --repeats 5 "
    "(then: loomserve bench compare A.json B.json).",
)
@click.option(
    "--scrape-metrics/--no-scrape-metrics",
    default=None,
    help="Sample the target's Prometheus /metrics every second into the JSON and report "
    "(queue, running, KV cache, server tokens/s). Default: on when the target has /metrics; "
    "e.g. --no-scrape-metrics when scraping it is costly.",
)
@click.option(
    "--label",
    default=None,
    help='Your name for this run, kept in the result JSON, e.g. --label "8 slots, spec on".',
)
@click.option(
    "--report",
    "report_html",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write one self-contained HTML report (no network), e.g. --report run.html.",
)
@click.option(
    "--result-json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write settings and summary (per sweep point) to this JSON file.",
)
@click.option("--save-detailed", is_flag=True, help="Also write every request to --result-json.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="PNG: TTFT/ITL distributions and throughput over time, or the sweep's curve.",
)
@click.option("--progress/--no-progress", default=True, help="Show a live progress bar.")
@click.option(
    "--self-test",
    is_flag=True,
    help="Measure the generator itself against a built-in instant server, and exit.",
)
@click.pass_context
def bench(ctx: click.Context, **opts) -> None:
    """Benchmark an OpenAI-compatible server (loomserve, llama-server, vLLM) under load.

    `loomserve bench compare A.json B.json` compares two result files.
    """
    if ctx.invoked_subcommand is not None:
        return
    if opts["self_test"]:
        from .selftest import run_self_test

        result = run_self_test(echo=click.echo)
        if opts["result_json"]:
            write_json(opts["result_json"], {"self_test": result})
        return
    try:
        config = build_config(opts)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        run_session(config, echo=click.echo, warn=_warn)
    except (BenchSetupError, WarmupFailed, ValueError) as exc:  # ValueError: a bad dataset
        raise click.ClickException(str(exc)) from exc


@bench.command("compare")
@click.argument("a", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("b", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def compare_command(a: Path, b: Path) -> None:
    """B's figures as ratios of A's, with 95% intervals where both ran --repeats.

    Example: loomserve bench compare before.json after.json
    """
    try:
        rows = compare(a, b)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_comparison(rows, str(a), str(b)))


def build_config(opts: dict) -> BenchConfig:
    """The BenchConfig for the parsed options; ValueError names what is wrong."""
    extra_body = None
    if opts["extra_body"]:
        extra_body = json.loads(opts["extra_body"])
        if not isinstance(extra_body, dict):
            raise ValueError("--extra-body must be a JSON object")
    dataset = opts["dataset"]
    if opts["dataset_path"] and dataset == "random":
        dataset = "sharegpt"  # a file given without --dataset can only mean ShareGPT
    sweep = None
    if opts["sweep"]:
        parameter, values = parse_sweep(opts["sweep"])
        sweep = (parameter, tuple(values))
    percentiles = tuple(sorted({*_percentiles(opts["percentiles"]), 99.0}))
    return BenchConfig(
        base_url=opts["base_url"],
        model=opts["model"],
        endpoint=opts["endpoint"],
        api_key=opts["api_key"],
        dataset=dataset,
        dataset_path=opts["dataset_path"],
        num_prompts=opts["num_prompts"],
        input_len=opts["input_len"],
        output_len=opts["output_len"],
        range_ratio=opts["range_ratio"],
        prefix_len=opts["prefix_len"],
        num_groups=opts["num_groups"],
        turns=opts["turns"],
        shape=LoadShape(
            request_rate=opts["request_rate"],
            burstiness=opts["burstiness"],
            max_concurrency=opts["max_concurrency"],
        ),
        sweep=sweep,
        num_warmups=opts["num_warmups"],
        duration_s=opts["duration"],
        timeout_s=opts["timeout"],
        seed=opts["seed"],
        ignore_eos=opts["ignore_eos"],
        temperature=opts["temperature"],
        tokenize=opts["tokenize"],
        slos_ms=parse_slos(opts["goodput"]),
        percentiles=percentiles,
        extra_body=extra_body,
        classes=tuple(parse_class(spec) for spec in opts["classes"]),
        result_json=opts["result_json"],
        save_detailed=opts["save_detailed"],
        plot=opts["plot"],
        progress=opts["progress"],
        label=opts["label"],
        find=opts["find"],
        attainment=opts["attainment"] / 100.0 if opts["attainment"] > 1 else opts["attainment"],
        find_precision=opts["find_precision"],
        repeats=opts["repeats"],
        scrape_metrics=opts["scrape_metrics"],
        report_html=opts["report_html"],
        time_scale=opts["time_scale"],
        trace_block_size=opts["trace_block_size"],
    )


if __name__ == "__main__":
    bench.main(prog_name="loomserve bench", auto_envvar_prefix="LOOMSERVE_BENCH")
