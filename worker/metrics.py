"""The worker's Prometheus metrics, named `loomserve:*` in the manner of vLLM's `vllm:*`.

The tick loop pays for a few counter increments and one histogram observation per tick,
and a few more per finished request. Load gauges (queue, slots, KV cells) and the scheduler's
counters are read when Prometheus scrapes, from the SchedulerStats the loop published after its
latest tick (stats.py), so keeping them costs the loop nothing and this thread never touches
the scheduler (a contract in pyproject.toml checks that it does not import it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..protocol import FinishReason
from .io.channels import StatsBoard
from .io.gateways import IOCounters
from .stats import FinishRecord, MediaRecord, TickRecord

TICK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
UBATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


class WorkerMetrics:
    """Every worker metric, in a registry of its own."""

    def __init__(self, tenant_labels: str = "name") -> None:
        """tenant_labels: how per-tenant series name a tenant (TenantLabels)."""
        self.registry = registry = CollectorRegistry()

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"loomserve:{name}", doc, labels, registry=registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"loomserve:{name}", doc, labels, registry=registry)

        self.requests_waiting = gauge("num_requests_waiting", "Requests queued for a slot.")
        self.requests_running = gauge("num_requests_running", "Requests holding a slot.")
        self.free_slots = gauge("free_slots", "Slots without a request.")
        self.kv_cells_used = gauge(
            "kv_cache_cells_used", "KV cache cells holding tokens, running and reusable."
        )
        self.kv_cells_total = gauge("kv_cache_cells_total", "KV cache cells: slots x context.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache cells in use (0-1).")
        self.gateways = gauge("gateways_connected", "Gateways that spoke within the timeout.")
        self.batch_occupancy = gauge(
            "batch_occupancy_perc", "Tokens in the latest tick's batch over its budget (0-1)."
        )
        self.rejected = counter(
            "requests_rejected", "Requests refused before they ran, by reason.", ("reason",)
        )
        # Labelled as the gateways' request_success: finished_reason, vLLM's name.
        self.finished = counter(
            "requests_finished", "Requests that finished, by finish reason.", ("finished_reason",)
        )
        self.cancelled = counter("requests_cancelled", "Requests cancelled, queued or running.")
        # Same name, same meaning as the gateways': every prompt token of a finished request,
        # cached or not. Evaluated ones are batch_tokens{kind="prefill"}.
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of finished requests, cached ones included."
        )
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens of finished requests, cached or not."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits",
            "Prompt tokens reused from a slot's cache or the RAM cache instead of evaluated.",
        )
        self.batch_tokens = counter(
            "batch_tokens",
            "Tokens in tick batches, by kind (decode, prefill, padding, draft).",
            ("kind",),
        )
        self.tick_seconds = Histogram(
            "loomserve:tick_duration_seconds",
            "Duration of one tick: input, batch, forward pass, sampling, output.",
            buckets=TICK_BUCKETS,
            registry=registry,
        )
        self.tick_tokens = Histogram(
            "loomserve:tick_batch_tokens",
            "Tokens in one tick's batch.",
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.info = gauge(
            "worker_info",
            "The worker's model and slots, in its labels; the value is 1.",
            ("model_name", "architecture", "slots", "slot_context"),
        )
        self.tick_ubatches = Histogram(
            "loomserve:tick_ubatches",
            "Forward passes (ubatches) llama.cpp makes of one tick's batch.",
            buckets=UBATCH_BUCKETS,
            registry=registry,
        )
        # Not the gateways' time_to_first_token_seconds, which counts from the HTTP arrival.
        self.ttft = Histogram(
            "loomserve:worker_time_to_first_token_seconds",
            "From acceptance to the first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            "loomserve:request_queue_time_seconds",
            "From acceptance to taking a slot.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_time_by_priority = Histogram(
            "loomserve:request_queue_time_by_priority_seconds",
            "From acceptance to taking a slot, by request priority (beyond ±9 grouped).",
            ("priority",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # Speculation, named as vLLM's vllm:spec_decode_* counters.
        self.spec_drafts = counter(
            "spec_decode_num_drafts", "Drafts verified: one per slot and tick that drafted."
        )
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Drafted tokens verified in a forward pass."
        )
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Drafted tokens the sampler agreed with."
        )
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafted tokens by their position in the draft (0: the first).",
            ("position",),
        )
        # Images (--mmproj): encoded on the encoder's thread, put in the cache in passes.
        self.images = counter("images_total", "Images of accepted requests.")
        self.images_cached = counter(
            "image_encoded_cache_hits_total", "Images taken from the encoded-image cache."
        )
        self.image_tokens = counter("image_tokens_total", "Prompt positions the images take.")
        self.image_encode_seconds = counter(
            "image_encode_seconds_total", "Seconds the encoder's thread spent on images."
        )
        self.image_passes = counter("image_passes_total", "Images put in the KV cache.")
        self.image_pass_seconds = counter(
            "image_pass_seconds_total", "Seconds of the image passes (the ticks wait for them)."
        )
        self.image_rows_in_token_passes = counter(
            "image_rows_in_token_passes_total",
            "Image rows that went in the ticks' token passes, beside the streams' tokens.",
        )
        self.image_token_passes = counter(
            "image_token_passes_total", "The ticks' token passes that carried image rows."
        )
        self._tenant_labels = TenantLabels(tenant_labels)
        self._decode = self.batch_tokens.labels(kind="decode")
        self._prefill = self.batch_tokens.labels(kind="prefill")
        self._padding = self.batch_tokens.labels(kind="padding")
        self._draft = self.batch_tokens.labels(kind="draft")
        self._finished_by_reason = {
            r.value: self.finished.labels(finished_reason=r.value) for r in FinishReason
        }

    def watch(
        self,
        board: StatsBoard,
        *,
        model_name: str,  # the gateways' model_info{model_name}
        architecture: str,
        slots: int,
        slot_context: int,
        io_counters: IOCounters | None = None,
    ) -> None:
        """Read the gauges from the board's latest stats, and the IO counters, at scrape time."""
        self.info.labels(
            model_name=model_name,
            architecture=architecture,
            slots=str(slots),
            slot_context=str(slot_context),
        ).set(1)
        cells_total = slots * slot_context
        self.kv_cells_total.set(cells_total)
        self.requests_waiting.set_function(lambda: board.latest.load.queue_depth)
        self.requests_running.set_function(lambda: board.latest.load.running)
        self.free_slots.set_function(lambda: board.latest.load.free_slots)
        self.kv_cells_used.set_function(lambda: board.latest.kv_cells_used)
        self.kv_usage.set_function(lambda: board.latest.kv_cells_used / cells_total)
        self.registry.register(_SchedulingCollector(board, self._tenant_labels))
        self.registry.register(_RamCacheCollector(board))
        if io_counters is not None:
            self.registry.register(_IOCollector(io_counters))

    def on_tick(self, record: TickRecord) -> None:
        self.tick_seconds.observe(record.seconds)
        n_tokens = record.decode_tokens + record.prefill_tokens
        self.tick_tokens.observe(n_tokens)
        self.batch_occupancy.set(n_tokens / record.budget)
        self._decode.inc(record.decode_tokens)
        self._prefill.inc(record.prefill_tokens)
        self._padding.inc(record.pad_tokens)
        self.tick_ubatches.observe(record.ubatches)
        self.generation_tokens.inc(record.sampled_tokens)
        if record.draft_tokens:
            self._padding.inc(record.filler_tokens)
            self._draft.inc(record.draft_tokens)
            self.spec_drafts.inc(record.drafts)
            self.spec_draft_tokens.inc(record.draft_tokens)
            self.spec_accepted_tokens.inc(record.accepted_tokens)
            for position, count in enumerate(record.accepted_per_position):
                self.spec_accepted_per_pos.labels(str(position)).inc(count)

    def on_finish(self, record: FinishRecord) -> None:
        finish = record.finish
        self._finished_by_reason[finish.reason].inc()
        if finish.reason == FinishReason.CANCELLED:
            self.cancelled.inc()
        self.prompt_tokens.inc(finish.prompt_tokens)
        self.prefix_queries.inc(finish.prompt_tokens)
        self.prefix_hits.inc(finish.cached_tokens)
        self.queue_time.observe(finish.queue_seconds)
        self._tenant_labels.label(record.tenant)
        self.queue_time_by_priority.labels(_priority_label(record.priority)).observe(
            finish.queue_seconds
        )
        if record.ttft_seconds is not None:
            self.ttft.observe(record.ttft_seconds)

    def on_media(self, record: MediaRecord) -> None:
        self.images.inc(record.images)
        self.images_cached.inc(record.cached_images)
        self.image_tokens.inc(record.image_tokens)
        self.image_encode_seconds.inc(record.encode_seconds)
        self.image_passes.inc(record.passes)
        self.image_pass_seconds.inc(record.pass_seconds)
        self.image_rows_in_token_passes.inc(record.shared_rows)
        self.image_token_passes.inc(record.shared_rows > 0)

    def on_reject(self, code: str) -> None:
        self.rejected.labels(reason=code).inc()

    def on_gateways(self, count: int) -> None:
        self.gateways.set(count)

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics on host:port from a daemon thread until close()."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.shutdown()
            server.server_close()


def _priority_label(priority: int) -> str:
    if priority < -9:
        return "<=-10"
    return ">=10" if priority > 9 else str(priority)


MAX_TENANT_LABELS = 16  # tenants beyond these (by first sight) are counted as "other"
OTHER_TENANT = "other"


TENANT_LABELS = ("name", "hash", "off")  # --metrics-tenants


def hashed_tenant(tenant: str) -> str:
    """A tenant's label that does not spell its name: the same on every worker and restart,
    so a dashboard can follow one tenant (a name easy to guess can still be guessed)."""
    return "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:12]


class TenantLabels:
    """The tenants with a label of their own: the first MAX_TENANT_LABELS seen, for good.

    mode: name, the tenant's own name; hash, hashed_tenant's; off, no per-tenant series.
    """

    def __init__(self, mode: str = "name") -> None:
        self.mode = mode
        self.names: dict[str, None] = {}  # insertion-ordered; only ever grows to the bound

    def label(self, tenant: str) -> str:
        shown = tenant if self.mode == "name" else hashed_tenant(tenant)
        if shown not in self.names and len(self.names) < MAX_TENANT_LABELS:
            self.names[shown] = None
        return shown if shown in self.names else OTHER_TENANT


class _SchedulingCollector:
    """Preemptions, swap space, per-tenant load and the tick-cost model, read at scrape time
    from the loop's snapshots: nothing on the loop's hot path."""

    def __init__(self, board: StatsBoard, labels: TenantLabels) -> None:
        self.board = board
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        stats = self.board.latest  # one tick's, whole
        preemptions = CounterMetricFamily(
            "loomserve:num_preemptions",
            "Running requests that gave their slot to a request of better priority.",
        )
        preemptions.add_metric([], stats.preemptions)
        yield preemptions
        yield GaugeMetricFamily(
            "loomserve:swap_space_used_bytes",
            "Host memory holding preempted requests' KV state.",
            value=stats.swap_used_bytes,
        )
        yield from self._tenants(stats.tenants)
        cost = stats.tick_cost
        model = GaugeMetricFamily(
            "loomserve:tick_cost_seconds",
            "The learned tick-cost model: seconds per tick (base) and per token of each kind.",
            labels=["term"],
        )
        model.add_metric(["base"], cost.base)
        model.add_metric(["decode_token"], cost.per_decode_token)
        model.add_metric(["prefill_token"], cost.per_prefill_token)
        yield model
        if stats.prefill_cap is not None:
            yield GaugeMetricFamily(
                "loomserve:itl_target_prefill_cap",
                "Prompt tokens the latency target allowed in its latest capped tick.",
                value=stats.prefill_cap,
            )

    def _tenants(self, counts: dict[str, tuple[int, int]]) -> Iterator[Metric]:
        if self.labels.mode == "off":
            return
        labels = [self.labels.label(tenant) for tenant in counts]
        by_label: dict[str, list[int]] = {tenant: [0, 0] for tenant in list(self.labels.names)}
        for label, (n_running, n_waiting) in zip(labels, counts.values(), strict=True):
            totals = by_label.setdefault(label, [0, 0])
            totals[0] += n_running
            totals[1] += n_waiting
        running = GaugeMetricFamily(
            "loomserve:num_requests_running_by_tenant",
            f"Requests holding a slot, per tenant (the first {MAX_TENANT_LABELS}, then other).",
            labels=["tenant"],
        )
        waiting = GaugeMetricFamily(
            "loomserve:num_requests_waiting_by_tenant",
            f"Requests queued for a slot, per tenant (the first {MAX_TENANT_LABELS}, then other).",
            labels=["tenant"],
        )
        for label, (n_running, n_waiting) in by_label.items():
            running.add_metric([label], n_running)
            waiting.add_metric([label], n_waiting)
        yield running
        yield waiting


class _RamCacheCollector:
    """The RAM prompt cache's counters and size (worker/cache/ram_cache.py), read at scrape time."""

    def __init__(self, board: StatsBoard) -> None:
        self.board = board

    def collect(self) -> Iterator[Metric]:
        stats = self.board.latest.ram_cache
        for name, doc, value in (
            ("hits", "Admissions whose prompt prefix was restored from the RAM cache.", stats.hits),
            (
                "restored_tokens",
                "Prompt tokens restored from the RAM cache instead of evaluated.",
                stats.restored_tokens,
            ),
            ("saves", "Slots' KV states saved to the RAM cache.", stats.saves),
            ("evictions", "RAM cache entries evicted to make room.", stats.evictions),
        ):
            counter = CounterMetricFamily(f"loomserve:ram_cache_{name}", doc)
            counter.add_metric([], value)
            yield counter
        yield GaugeMetricFamily(
            "loomserve:ram_cache_used_bytes",
            "Host memory held by the RAM cache.",
            value=stats.used_bytes,
        )
        yield GaugeMetricFamily(
            "loomserve:ram_cache_capacity_bytes",
            "The RAM cache's budget (--cache-ram).",
            value=stats.capacity_bytes,
        )
        yield GaugeMetricFamily(
            "loomserve:ram_cache_entries", "Sequences held in the RAM cache.", value=stats.entries
        )


class _IOCollector:
    """The IO thread's plain counters, reported at scrape time: no locks on its hot path."""

    def __init__(self, counters: IOCounters) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        dropped = CounterMetricFamily(
            "loomserve:messages_dropped",
            "Messages dropped, by reason: slow (gateway's queue full), gone, malformed.",
            labels=["reason"],
        )
        dropped.add_metric(["slow"], self.counters.dropped_slow)
        dropped.add_metric(["gone"], self.counters.dropped_gone)
        dropped.add_metric(["malformed"], self.counters.malformed)
        yield dropped
        lost = CounterMetricFamily(
            "loomserve:gateways_lost", "Gateways given up on: silent too long, or disconnected."
        )
        lost.add_metric([], self.counters.gateways_lost)
        yield lost
