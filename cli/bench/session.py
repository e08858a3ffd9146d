"""A whole `loomserve bench` invocation: set up, run every load shape, report."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loomserve.cli.bench import report
from loomserve.cli.bench.classes import (
    RequestClass,
    assign_classes,
    class_dict,
    class_metrics,
    format_class_table,
)
from loomserve.cli.bench.client import StreamingClient
from loomserve.cli.bench.datasets import (
    BenchRequest,
    TokenCounter,
    approximate_token_counts,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
    sharegpt_dataset,
)
from loomserve.cli.bench.grounded import input_grounded_dataset
from loomserve.cli.bench.metrics import BenchmarkMetrics, compute_metrics, pacing_stats
from loomserve.cli.bench.probe import ServerTokenizer, first_model
from loomserve.cli.bench.runner import LoadShape, RunResult, run_load, warm_up
from loomserve.cli.bench.sweep import sweep_shapes

DATASETS = ("random", "shared-prefix", "sharegpt", "input-grounded", "multi-turn")
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

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.dataset == "sharegpt" and self.dataset_path is None:
            raise ValueError("the sharegpt dataset needs --dataset-path")
        if self.num_prompts < 1 or self.turns < 1:
            raise ValueError("--num-prompts and --turns must be at least 1")
        if self.input_len < 1 or (self.output_len is not None and self.output_len < 1):
            raise ValueError("--input-len and --output-len must be at least 1")
        if self.shape.max_concurrency is not None and self.shape.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if self.duration_s <= 0 or self.timeout_s <= 0:
            raise ValueError("--duration and --timeout must be positive")

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
    return sharegpt_dataset(config.dataset_path, config.num_prompts, config.output_len, seed, count)


def settings_dict(config: BenchConfig, model: str, token_counts: str) -> dict[str, Any]:
    """The settings as the result JSON records them."""
    settings = asdict(config)
    settings |= {
        "model": model,
        "token_counts": token_counts,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    for key in ("dataset_path", "result_json", "plot"):
        settings[key] = str(settings[key]) if settings[key] is not None else None
    settings.pop("api_key")
    return settings


def input_source(run: RunResult, token_counts: str) -> str:
    """Where the input token total came from, for the summary line."""
    done = [r for r in run.records if r.success]
    if done and all(r.prompt_tokens is not None for r in done):
        return "server usage"
    return "server /tokenize" if token_counts.startswith("server") else "estimated"


def describe_shape(shape: LoadShape) -> str:
    rate = "inf" if math.isinf(shape.request_rate) else f"{shape.request_rate:g} req/s"
    process = "Poisson" if shape.burstiness == 1.0 else f"gamma, burstiness {shape.burstiness:g}"
    return f"request rate {rate} ({process}), max concurrency {shape.max_concurrency or 'none'}"


async def run_shapes(
    config: BenchConfig,
    model: str,
    prompt_sets: list[list[BenchRequest]],
    echo: Callable[..., None],
) -> list[RunResult]:
    """Warm up once, then run each load shape over its own prompts."""
    shapes = config.shapes()
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
    try:
        if config.num_warmups:
            echo(f"Warming up with {config.num_warmups} requests...")
            await warm_up(client, prompt_sets[0][0], config.num_warmups, shapes[0].max_concurrency)
        runs = []
        for shape, requests in zip(shapes, prompt_sets, strict=True):
            echo(f"Running {len(requests)} requests: {describe_shape(shape)}")
            runs.append(
                await run_load(
                    client,
                    requests,
                    shape,
                    config.seed,
                    duration_s=config.duration_s,
                    progress=config.progress,
                )
            )
        return runs
    finally:
        await client.aclose()


def run_session(
    config: BenchConfig,
    echo: Callable[..., None] = print,
    warn: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the benchmark the config describes; print and write its results, and return them."""
    model = config.model or first_model(config.base_url, config.api_key)
    count: TokenCounter = approximate_token_counts
    token_counts = "estimated at 4 characters a token"
    tokenizer = ServerTokenizer(config.base_url, model, config.api_key)
    try:
        if config.tokenize and tokenizer.available():
            count, token_counts = tokenizer.count, "server /tokenize"
        # Each sweep point draws its own prompts: a server's prompt cache must not turn the
        # prompts of one point into cache hits at the next.
        prompt_sets = [
            build_requests(config, count, config.seed + point)
            for point in range(len(config.shapes()))
        ]
    finally:
        tokenizer.close()
    requests = prompt_sets[0]
    if len(requests) < config.num_prompts:
        warn(f"the dataset yielded {len(requests)} usable prompts of {config.num_prompts} asked")
    mean_in = sum(r.prompt_len for r in requests) / len(requests)
    mean_out = sum(r.output_len for r in requests) / len(requests)
    echo(
        f"Model {model} at {config.base_url} ({config.endpoint}); dataset {config.dataset}: "
        f"{len(requests)} prompts, ~{mean_in:.0f} input tokens ({token_counts}), "
        f"{mean_out:.0f} output tokens"
    )
    runs = asyncio.run(run_shapes(config, model, prompt_sets, echo))

    points: list[dict[str, Any]] = []
    summaries: list[BenchmarkMetrics] = []
    for run in runs:
        metrics = compute_metrics(run.records, run.duration_s, config.slos_ms, config.percentiles)
        pacing = pacing_stats(run.records, run.shape.request_rate)
        echo(report.format_summary(metrics, run, pacing, input_source(run, token_counts)))
        notes = report.run_warnings(metrics, run, pacing)
        for note in notes:
            warn(note)
        point: dict[str, Any] = {
            "shape": report.shape_dict(run),
            "summary": report.summary_dict(metrics),
            "generator": report.generator_dict(run, pacing),
            "warnings": notes,
        }
        if config.classes:
            rows = class_metrics(run.records, config.classes, config.percentiles)
            echo(format_class_table(rows))
            point["classes"] = {row.name: class_dict(row) for row in rows}
        if config.save_detailed:
            point["requests"] = [report.request_dict(r) for r in run.records]
        points.append(point)
        summaries.append(metrics)

    result: dict[str, Any] = {"settings": settings_dict(config, model, token_counts)}
    if config.sweep is None:
        result |= points[0]
    else:
        parameter, values = config.sweep
        table = list(zip(values, summaries, strict=True))
        echo(report.format_sweep_table(parameter, table))
        result["sweep"] = {"parameter": parameter, "points": points}
        for point, value in zip(points, values, strict=True):
            point["value"] = value
    if config.result_json:
        report.write_json(config.result_json, result)
        echo(f"Wrote {config.result_json}")
    if config.plot:
        if config.sweep is None:
            title = f"{model}: {describe_shape(runs[0].shape)}"
            report.plot_run(config.plot, runs[0].records, title)
        else:
            report.plot_sweep(config.plot, config.sweep[0], table)
        echo(f"Wrote {config.plot}")
    return result
