"""The stats the loop publishes for other threads (/slots, heartbeats, metrics): at once when
the load changes, and otherwise at most every STATS_EVERY, not each tick."""

from __future__ import annotations

import pytest

from loomserve.worker.engine.engine import Engine
from loomserve.worker.tick import loop as tick_loop
from tests.worker.engine.test_engine import GW, drain, greedy, new_loop
from tests.worker.engine.test_engine import config as config  # the fixture


def test_stats_follow_the_load_at_once_and_the_counters_within_the_period(
    config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tick_loop, "STATS_EVERY", 3600.0)  # no refresh but by the load
    engine = Engine(config)
    try:
        loop, _ = new_loop(engine, config)
        loop.inbox.submit(GW, greedy("long", [1, 20, 21, 22], 40, ignore_eos=True))
        while not any(
            slot.request and slot.request.completion_tokens for slot in loop.scheduler.slots
        ):
            loop.tick(block=False)
        admitted = loop.board.latest
        assert admitted.load.running == 1 and admitted.busy[0].request_id == "long"
        for _ in range(5):  # decode ticks: the load is the same, the stats are not rebuilt
            loop.tick(block=False)
        assert loop.board.latest is admitted
        # A second request queues, then runs: both change the load, published at once.
        loop.inbox.submit(GW, greedy("short", [1, 30], 3, ignore_eos=True))
        loop.tick(block=False)
        assert loop.board.latest.load.running == 2
        drain(loop)
        ended = loop.board.latest
        assert ended.load.running == 0 and not ended.busy
        assert ended.kv_cells_used == sum(slot.n_in_cache for slot in loop.scheduler.slots)

        monkeypatch.setattr(tick_loop, "STATS_EVERY", 0.0)  # every tick
        loop.inbox.submit(GW, greedy("again", [1, 40, 41], 20, ignore_eos=True))
        loop.tick(block=False)
        loop.tick(block=False)
        before = loop.board.latest
        loop.tick(block=False)
        after = loop.board.latest
        assert after is not before and after.kv_cells_used == before.kv_cells_used + 1
        drain(loop)
    finally:
        engine.close()
