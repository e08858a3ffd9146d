"""The SchedulerStats the loop publishes after each tick (stats.py, sched/records.py) and the
worker's metrics, which read nothing else of the loop; pure Python, no model."""

from __future__ import annotations

import dataclasses

import pytest

from loomserve.protocol import Load, SamplingParams
from loomserve.worker.io.channels import StatsBoard
from loomserve.worker.metrics import WorkerMetrics
from loomserve.worker.sched.records import scheduler_stats
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.sched.slots import Request
from loomserve.worker.sched.tick_cost import LatencyTarget, TickCostModel
from loomserve.worker.stats import RamCacheUsage, SchedulerStats, TickCost

GW = b"gw"


def test_the_stats_copy_the_schedulers_counters_and_cannot_change() -> None:
    latency = LatencyTarget(0.05, TickCostModel())
    scheduler = Scheduler(
        n_slots=2,
        max_queue=4,
        slot_context=1024,
        swap_bytes=1 << 20,
        latency=latency,
        ram_cache_bytes=1 << 20,
    )
    scheduler.enqueue(Request((GW, "r"), [1, 2, 3], SamplingParams(), arrived_at=0.0))
    (admission,) = scheduler.admit(tick=1, now=1.0)
    admission.slot.n_in_cache = 3
    scheduler.preemptions, latency.latest_cap = 2, 96
    scheduler.swap.used = 4096
    scheduler.ram.stats.hits, scheduler.ram.stats.saves = 5, 7
    cost = TickCost(0.01, 0.002, 0.0001)

    stats = scheduler_stats(scheduler, cost, prefixes=(11, 12))

    assert (stats.load, stats.n_slots) == (Load(queue_depth=0, free_slots=1, running=1), 2)
    assert (stats.kv_cells_used, stats.prefixes, stats.tick_cost) == (3, (11, 12), cost)
    assert (stats.preemptions, stats.swap_used_bytes, stats.prefill_cap) == (2, 4096, 96)
    assert stats.ram_cache == RamCacheUsage(5, 0, 7, 0, 0, 1 << 20, 0)
    assert [snapshot.request_id for snapshot in stats.busy] == ["r"]
    assert stats.busy[0].phase == "prefilling"
    scheduler.preemptions = 3  # the loop goes on; the published copy does not
    assert stats.preemptions == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.preemptions = 4  # type: ignore[misc]


def test_the_metrics_read_the_latest_published_stats_at_scrape_time() -> None:
    board = StatsBoard(slots=4)
    metrics = WorkerMetrics()
    metrics.watch(board, model_name="m", architecture="llama", slots=4, slot_context=256)
    sample = metrics.registry.get_sample_value
    assert sample("loomserve:num_requests_running") == 0
    assert sample("loomserve:num_preemptions_total") == 0

    board.publish(
        SchedulerStats(
            Load(queue_depth=3, free_slots=1, running=3),
            tenants={"team": (2, 3), "default": (1, 0)},
            kv_cells_used=512,
            n_slots=4,
            preemptions=6,
            swap_used_bytes=8192,
            prefill_cap=64,
            tick_cost=TickCost(0.02, 0.003, 0.0004),
            ram_cache=RamCacheUsage(1, 40, 2, 3, 1000, 2000, 4),
        )
    )

    assert sample("loomserve:num_requests_waiting") == 3
    assert sample("loomserve:num_requests_running") == 3
    assert sample("loomserve:kv_cache_usage_perc") == 0.5
    assert sample("loomserve:num_preemptions_total") == 6
    assert sample("loomserve:swap_space_used_bytes") == 8192
    assert sample("loomserve:itl_target_prefill_cap") == 64
    assert sample("loomserve:tick_cost_seconds", {"term": "decode_token"}) == 0.003
    assert sample("loomserve:num_requests_waiting_by_tenant", {"tenant": "team"}) == 3
    assert sample("loomserve:ram_cache_evictions_total") == 3
    assert sample("loomserve:ram_cache_used_bytes") == 1000
    assert sample("loomserve:ram_cache_entries") == 4
