"""A whole `loomserve bench` invocation: set up, run every load shape, report."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import report
from .classes import RequestClass, assign_classes
from .client import StreamingClient
from .datasets import (
    BenchRequest,
    TokenCounter,
    approximate_token_counts,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
    sharegpt_dataset,
)
from .driver import Driver, Outcome, Plan, describe_shape
from .grounded import input_grounded_dataset
from .html_report import write_html_report
from .metrics import BenchmarkMetrics
from .points import PointSettings
from .probe import ServerTokenizer, first_model, server_identity
from .runner import LoadShape
from .scrape import MetricsScraper
from .search import MODES, search_dict
from .sweep import sweep_shapes
from .trace import prompts_dataset, trace_dataset

DATASETS = (
    "random",
    "shared-prefix",
    "sharegpt",
    "input-grounded",
    "multi-turn",
    "trace",
    "jsonl",
)
FILE_DATASETS = frozenset({"sharegpt", "trace", "jsonl"})
DEFAULT_OUTPUT_LEN = 128


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Every setting of one benchmark invocation."""

    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first of /v1/models
    endpoint: str = "completions"  # or "chat"
    api_key: str | None = None
    dataset: str = "random"
    dataset_path: Path | None = None  # a ShareGPT JSON file
    num_prompts: int = 100
    input_len: int = 256
    output_len: int | None = None  # None: 128, or each ShareGPT answer's length
    range_ratio: float = 0.0
    prefix_len: int = 512  # shared-prefix: tokens of each group's system prompt
    num_groups: int = 4  # shared-prefix: how many distinct system prompts
    turns: int = 4  # multi-turn: turns per conversation (num_prompts conversations)
    shape: LoadShape = field(default_factory=LoadShape)
    sweep: tuple[str, tuple[float, ...]] | None = None  # (parameter, values)
    num_warmups: int = 1
    duration_s: float = 3600.0  # hard bound on each run
    timeout_s: float = 600.0  # per request
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    tokenize: bool = True  # count prompt tokens with the server's /tokenize when it has one
    slos_ms: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (90.0, 99.0)
    extra_body: dict[str, Any] | None = None
    classes: tuple[RequestClass, ...] = ()  # a mix of priorities and tenants (--class)
    result_json: Path | None = None
    save_detailed: bool = False
    plot: Path | None = None
    progress: bool = True
    label: str | None = None  # the user's name for this run, kept in the result JSON
    find: str | None = None  # "max-rate" or "max-concurrency": search instead of one run
    attainment: float = 0.9  # --find: the share of requests that must meet every SLO
    find_precision: float = 0.1  # --find: relative width of the final bracket
    repeats: int = 1  # runs per point, for means and 95 % intervals
    scrape_metrics: bool | None = None  # None: when the target serves /metrics
    report_html: Path | None = None
    time_scale: float = 1.0  # trace: due time = timestamp x time_scale
    trace_block_size: int = 512  # trace: prompt tokens per hash id

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.dataset in FILE_DATASETS and self.dataset_path is None:
            raise ValueError(f"the {self.dataset} dataset needs --dataset-path")
        if self.num_prompts < 1 or self.turns < 1:
            raise ValueError("--num-prompts and --turns must be at least 1")
        if self.input_len < 1 or (self.output_len is not None and self.output_len < 1):
            raise ValueError("--input-len and --output-len must be at least 1")
        if self.shape.max_concurrency is not None and self.shape.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.duration_s <= 0 or self.timeout_s <= 0:
            raise ValueError("--duration and --timeout must be positive")
        if self.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        if self.find is not None:
            if self.find not in MODES:
                raise ValueError(f"--find must be one of {sorted(MODES)}, got {self.find!r}")
            if not self.slos_ms:
                raise ValueError('--find needs SLOs: --goodput "ttft:500 tpot:50"')
            if self.sweep is not None or self.repeats > 1:
                raise ValueError("--find runs its own probes: drop --sweep and --repeats")
            if self.dataset in ("trace", "multi-turn"):
                raise ValueError(f"--find varies the load, which the {self.dataset} dataset sets")
        if not 0 < self.attainment <= 1:
            raise ValueError("--attainment must be a share in (0, 1], or a percentage")
        if not 0 < self.find_precision < 1:
            raise ValueError("--find-precision must lie between 0 and 1")

    def shapes(self) -> list[LoadShape]:
        """The load shapes to run: one, or one per sweep value."""
        if self.sweep is None:
            return [self.shape]
        parameter, values = self.sweep
        return sweep_shapes(self.shape, parameter, list(values))


def build_requests(config: BenchConfig, count: TokenCounter, seed: int) -> list[BenchRequest]:
    """The prompts of the configured dataset, drawn with this seed, in their classes."""
    return assign_classes(_dataset(config, count, seed), config.classes, seed)


def _dataset(config: BenchConfig, count: TokenCounter, seed: int) -> list[BenchRequest]:
    output_len = config.output_len or DEFAULT_OUTPUT_LEN
    if config.dataset == "random":
        return random_dataset(
            config.num_prompts,
            config.input_len,
            output_len,
            config.range_ratio,
            seed,
            count,
        )
    if config.dataset == "input-grounded":  # the answer repeats the prompt's passage
        return input_grounded_dataset(
            config.num_prompts, config.input_len, config.output_len, config.range_ratio, seed, count
        )
    if config.dataset == "shared-prefix":
        return shared_prefix_dataset(
            config.num_prompts,
            config.num_groups,
            config.prefix_len,
            config.input_len,
            output_len,
            config.range_ratio,
            seed,
            count,
        )
    if config.dataset == "multi-turn":
        return multi_turn_dataset(
            config.num_prompts,
            config.turns,
            config.prefix_len,
            config.input_len,
            output_len,
            config.range_ratio,
            seed,
            count,
        )
    assert config.dataset_path is not None
    if config.dataset == "trace":
        return trace_dataset(
            config.dataset_path,
            config.num_prompts,
            config.trace_block_size,
            config.time_scale,
            seed,
            count,
        )
    if config.dataset == "jsonl":
        return prompts_dataset(config.dataset_path, config.num_prompts, output_len, count)
    return sharegpt_dataset(config.dataset_path, config.num_prompts, config.output_len, seed, count)


def settings_dict(config: BenchConfig, model: str, token_counts: str) -> dict[str, Any]:
    """The settings as the result JSON records them."""
    settings = asdict(config)
    settings |= {
        "model": model,
        "token_counts": token_counts,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    for key in ("dataset_path", "result_json", "plot", "report_html"):
        settings[key] = str(settings[key]) if settings[key] is not None else None
    settings.pop("api_key")
    return settings


def plan_for(config: BenchConfig) -> Plan:
    """The runs the config asks for."""
    return Plan(
        shapes=config.shapes(),
        seed=config.seed,
        duration_s=config.duration_s,
        num_warmups=config.num_warmups,
        repeats=config.repeats,
        progress=config.progress,
        find=config.find,
        attainment=config.attainment,
        find_precision=config.find_precision,
    )


async def drive(
    config: BenchConfig,
    model: str,
    prompts: Callable[[int], list[BenchRequest]],
    token_counts: str,
    echo: Callable[..., None],
    warn: Callable[[str], None],
) -> Outcome:
    """Open the client (and the metrics scraper), run the plan, close them."""
    client = StreamingClient(
        config.base_url,
        model,
        endpoint=config.endpoint,
        api_key=config.api_key,
        timeout_s=config.timeout_s,
        ignore_eos=config.ignore_eos,
        temperature=config.temperature,
        extra_body=config.extra_body,
    )
    scraper = None
    if config.scrape_metrics is not False:
        scraper = MetricsScraper(config.base_url, config.api_key)
        if (reason := await scraper.unavailable_reason()) is not None:
            if config.scrape_metrics:
                warn(f"--scrape-metrics: {reason}; the run goes on without server metrics")
            await scraper.aclose()
            scraper = None
        else:
            echo(f"Sampling {scraper.url} every second")
    settings = PointSettings(
        dataset=config.dataset,
        seed=config.seed,
        slos_ms=config.slos_ms,
        percentiles=config.percentiles,
        classes=config.classes,
        save_detailed=config.save_detailed,
        token_counts=token_counts,
    )
    driver = Driver(plan_for(config), client, prompts, settings, echo, warn, scraper)
    try:
        return await driver.run()
    finally:
        await client.aclose()
        if scraper is not None:
            await scraper.aclose()


def run_session(
    config: BenchConfig,
    echo: Callable[..., None] = print,
    warn: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the benchmark the config describes; print and write its results, and return them."""
    model = config.model or first_model(config.base_url, config.api_key)
    identity = server_identity(config.base_url, config.api_key, model)
    count: TokenCounter = approximate_token_counts
    token_counts = "estimated at 4 characters a token"
    tokenizer = ServerTokenizer(config.base_url, model, config.api_key)
    try:
        if config.tokenize and tokenizer.available():
            count, token_counts = tokenizer.count, "server /tokenize"

        # Each sweep point, repeat and probe draws its own prompts (seed + its index): a
        # server's prompt cache must not turn one point's prompts into the next one's hits.
        def prompts(seed: int) -> list[BenchRequest]:
            return build_requests(config, count, seed)

        requests = prompts(config.seed)
        if len(requests) < config.num_prompts:
            warn(
                f"the dataset yielded {len(requests)} usable prompts of {config.num_prompts} asked"
            )
        mean_in = sum(r.prompt_len for r in requests) / len(requests)
        mean_out = sum(r.output_len for r in requests) / len(requests)
        echo(
            f"Model {model} at {config.base_url} ({config.endpoint}); dataset {config.dataset}: "
            f"{len(requests)} prompts, ~{mean_in:.0f} input tokens ({token_counts}), "
            f"{mean_out:.0f} output tokens"
        )
        cache = {config.seed: requests}  # drawn once; the driver asks for the first set again
        outcome = asyncio.run(
            drive(
                config,
                model,
                lambda seed: cache.pop(seed, None) or prompts(seed),
                token_counts,
                echo,
                warn,
            )
        )
    finally:
        tokenizer.close()
    return finish(config, model, token_counts, identity, outcome, echo)


def finish(
    config: BenchConfig,
    model: str,
    token_counts: str,
    identity: dict[str, Any],
    outcome: Outcome,
    echo: Callable[..., None],
) -> dict[str, Any]:
    """Assemble the result, print the sweep table, and write the JSON, plot and report."""
    result: dict[str, Any] = {
        "label": config.label,
        "server": identity,
        "settings": settings_dict(config, model, token_counts),
    }
    table: list[tuple[float, BenchmarkMetrics]] = []
    if outcome.search is not None:
        result["search"] = search_dict(outcome.search)
    elif config.sweep is None:
        result |= outcome.points[0]
    else:
        parameter, values = config.sweep
        table = list(zip(values, outcome.metrics, strict=True))
        summaries = [(v, p["summary"]) for v, p in zip(values, outcome.points, strict=True)]
        echo(report.format_sweep_table(parameter, summaries))
        result["sweep"] = {"parameter": parameter, "points": outcome.points}
        for point, value in zip(outcome.points, values, strict=True):
            point["value"] = value
    if config.result_json:
        report.write_json(config.result_json, result)
        echo(f"Wrote {config.result_json}")
    if config.plot and outcome.runs and outcome.search is None:  # a search's curve: --report
        if config.sweep is None:
            title = f"{model}: {describe_shape(outcome.runs[0].shape)}"
            report.plot_run(config.plot, outcome.runs[0].records, title)
        else:
            report.plot_sweep(config.plot, config.sweep[0], table)
        echo(f"Wrote {config.plot}")
    if config.report_html:
        write_html_report(config.report_html, result)
        echo(f"Wrote {config.report_html}")
    return result
