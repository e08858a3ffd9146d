"""Prometheus metrics of one gateway, or of every gateway on the host in multiprocess mode.

With PROMETHEUS_MULTIPROC_DIR set (before this process imports prometheus_client), each
gateway process writes its values to files in that directory and any of them answers
/metrics for all; `mark_dead` on exit drops the exiting process's live gauges.
"""

from __future__ import annotations

import contextlib
import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)

PREFIX = "loomserve:"

disable_created_metrics()  # the *_created series only add noise to every counter

# vLLM's buckets, so dashboards built for it read ours the same way.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
RTT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
               1.0, 2.5)  # fmt: skip


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class GatewayMetrics:
    """Every metric the gateway records, registered in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests answered, by route and status.",
            ["route", "status"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From the request's arrival to its first generated token.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between two generated tokens of one request.",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "From the request's arrival to its last token.",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Time requests waited in the worker's queue for a slot.",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests_in_flight = Gauge(
            PREFIX + "requests_in_flight",
            "Generation requests (streaming or not) this host's gateways are serving.",
            ["model_name"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.worker_rtt = Histogram(
            PREFIX + "worker_rtt_seconds",
            "Round trip gateway -> worker -> gateway, from Ping and Heartbeat.",
            buckets=RTT_BUCKETS,
            registry=r,
        )
        self.client_disconnects = Counter(
            PREFIX + "client_disconnects",
            "Requests whose client went away before the end; each was cancelled in the worker.",
            ["model_name"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of finished requests, cached ones included (each choice counts).",
            ["model_name"],
            registry=r,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens",
            "Tokens generated for clients.",
            ["model_name"],
            registry=r,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests that finished, by model and finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )

        self.model_info = Gauge(
            PREFIX + "model_info",
            "The models the API serves, by served name; the value is 1.",
            ["model_name"],
            multiprocess_mode="max",
            registry=r,
        )
        self.model_state = Gauge(
            PREFIX + "model_state",
            "1 for each model's state now (loaded, loading, unloading, unloaded, unavailable), "
            "0 for the others.",
            ["model_name", "state"],
            multiprocess_mode="livemostrecent",  # every gateway sees the same states
            registry=r,
        )

        # Per worker, labelled by its endpoint (bounded: the configured and resolved workers;
        # a worker that leaves the resolved set has its series removed).
        self.worker_requests_routed = Counter(
            PREFIX + "worker_requests_routed",
            "Generation requests sent to each worker (resent ones counted again).",
            ["worker"],
            registry=r,
        )
        self.worker_requests_in_flight = Gauge(
            PREFIX + "worker_requests_in_flight",
            "Requests sent to each worker that have not finished.",
            ["worker"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.worker_up = Gauge(
            PREFIX + "worker_up",
            "1 while a worker is in rotation (connected, ready, same model), else 0.",
            ["worker"],
            multiprocess_mode="livemin",
            registry=r,
        )
        self.worker_prefix_affinity_hits = Counter(
            PREFIX + "worker_prefix_affinity_hits",
            "Requests sent to the worker that last served their prompt's first block.",
            ["worker"],
            registry=r,
        )
        # The worker's own load, as its latest heartbeat told this gateway: under `serve` the
        # worker has no metrics port unless given one, and these need none.
        self.worker_load = {
            name: Gauge(
                PREFIX + "worker_" + name,
                doc,
                ["worker"],
                multiprocess_mode="livemostrecent",  # every gateway hears the same worker
                registry=r,
            )
            for name, doc in (
                ("num_requests_running", "Requests holding one of the worker's slots."),
                ("num_requests_waiting", "Requests in the worker's queue."),
                ("free_slots", "The worker's slots without a request."),
                ("kv_cache_usage_perc", "Fraction (0-1) of the worker's KV cache cells in use."),
            )
        }
        self.requests_rerouted = Counter(
            PREFIX + "requests_rerouted",
            "Requests sent to a second worker: the first could not take them, or was lost "
            "before their first token.",
            ["reason"],
            registry=r,
        )

    def forget_worker(self, endpoint: str) -> None:
        """Drop a worker's series: it left the resolved set (bounds the label values)."""
        for metric in (
            self.worker_requests_routed,
            self.worker_requests_in_flight,
            self.worker_up,
            self.worker_prefix_affinity_hits,
            *self.worker_load.values(),
        ):
            with contextlib.suppress(KeyError):
                metric.remove(endpoint)

    def set_worker_load(
        self, endpoint: str, running: int, waiting: int, free_slots: int, kv_usage: float
    ) -> None:
        """A worker's load from its latest heartbeat."""
        load = self.worker_load
        load["num_requests_running"].labels(endpoint).set(running)
        load["num_requests_waiting"].labels(endpoint).set(waiting)
        load["free_slots"].labels(endpoint).set(free_slots)
        load["kv_cache_usage_perc"].labels(endpoint).set(kv_usage)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type (every gateway's, in multiprocess mode)."""
        registry = self.registry
        if multiprocess_dir():
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST


def mark_dead(pid: int) -> None:
    """Drop a finished process's live gauges from the shared directory (multiprocess mode)."""
    if multiprocess_dir():
        multiprocess.mark_process_dead(pid)
