"""How many forward passes a tick costs: the model of llama.cpp's split, pinned to the passes
the real engine makes (counted through ggml's graph callback), and the scheduler's levers."""

from __future__ import annotations

import random
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from loomserve.protocol import FinishReason, Generate, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.sched.slots import Request, Slot
from loomserve.worker.sched.ubatches import (
    MIN_BRIDGED_GAP,
    SplitRules,
    count_ubatches,
    gaps_to_bridge,
)
from loomserve.worker.stats import TickRecord
from loomserve.worker.tick.loop import TickLoop
from tests.forward_passes import PassCounter

GW = b"gw"


# --- the model of split_equal, pure ---------------------------------------------------------


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        ([(s, 1) for s in range(8)], 1),  # decode tokens in slot order: one pass
        ([(s, 1) for s in (0, 1, 2, 4, 5)], 2),  # one idle slot splits it
        ([(s, 1) for s in (3, 2, 1, 0)], 4),  # ids must rise in batch order
        ([(0, 1), (1, 9), (2, 1)], 2),  # one token of each, then the rest of the prompt
        ([(0, 1), (2, 1), (1, 9)], 3),  # 1 joins 0 from later on; 2, before 1, cannot
        ([(0, 1), (1, 9), (2, 9)], 2),  # neighbouring chunks of one length share a pass
        ([(0, 1), (1, 9), (2, 5)], 3),
        ([(0, 40)], 2),  # over n_ubatch (32): cut by size
        ([(0, 20), (1, 20)], 2),  # two sequences: 16 tokens each per pass at most
        ([(0, 40), (1, 2)], 3),  # 2 + 2, then the 38 left of 0: 32 and 6
    ],
)
def test_count_ubatches_follows_split_equal(runs, expected):
    assert count_ubatches(runs, n_ubatch=32, per_seq_streams=True) == expected


def test_one_stream_cuts_by_size_alone():
    runs = [(s, 1) for s in (5, 0, 3)] + [(1, 30)]
    assert count_ubatches(runs, n_ubatch=32, per_seq_streams=False) == 2
    assert count_ubatches(runs[:3], n_ubatch=32, per_seq_streams=False) == 1


def test_short_gaps_are_bridged_shortest_first_within_room():
    in_batch = [0, 1, 3, 4, 8, 9, 30]
    assert gaps_to_bridge(in_batch, lambda s: True, room=10) == [2, 5, 6, 7]
    assert gaps_to_bridge(in_batch, lambda s: True, room=2) == [2]
    assert gaps_to_bridge(in_batch, lambda s: s != 6, room=10) == [2]  # a gap is whole or none


# --- the model against llama.cpp ------------------------------------------------------------


@pytest.fixture
def config(tiny_model_path: Path) -> WorkerConfig:
    return WorkerConfig(
        model_path=tiny_model_path, slots=8, ctx_size=64, batch_tokens=32, threads=1
    )


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_the_count_is_the_passes_llama_cpp_makes(config, batch_invariant):
    counter = PassCounter()
    engine = counter.engine(replace(config, batch_invariant=batch_invariant))
    rng = random.Random(5)
    try:
        for _ in range(60):
            engine.clear_cache()
            seqs = rng.sample(range(8), rng.randrange(1, 9))
            if rng.random() < 0.5:
                seqs.sort()
            runs, room = [], 32 - len(seqs)  # room beyond one token per sequence
            for seq in seqs:
                extra = min(rng.choice([0, 0, rng.randrange(20)]), room)
                runs.append((seq, 1 + extra))
                room -= extra
            engine.batch.clear()
            for seq, n in runs:
                engine.batch.add_run([5] * n, 0, seq, True)
            before = counter.passes
            assert engine.decode(engine.batch) == 0
            predicted = count_ubatches(runs, 32, engine.split_rules.per_slot_streams)
            assert counter.passes - before == predicted, runs
    finally:
        engine.close()


class Null:
    def send(self, gateway, message) -> None:
        pass

    def flush(self) -> None:
        pass


def test_every_tick_reports_the_passes_it_made(config):
    """Staggered requests of random lengths: each tick's ubatches is what llama.cpp did, a
    decode-only tick whose slots' gaps can be bridged is one pass, and a mixed one costs at
    most one more per prompt chunk."""
    counter = PassCounter()
    engine = counter.engine(replace(config, prefill_chunk=7))
    records: list[tuple[TickRecord, int]] = []
    loop = TickLoop(engine, engine.config, Null(), on_tick=lambda r: records.append((r, 0)))
    decoding: list[list[int]] = []  # each tick's decoding slots, in slot order
    schedule = loop.scheduler.schedule

    def recording_schedule(budget: int, chunk_size: int):
        step = schedule(budget, chunk_size)
        decoding.append([run.slot.index for run in step.runs if not run.pad])
        return step

    loop.scheduler.schedule = recording_schedule
    rng = random.Random(3)
    try:
        submitted = 0
        while submitted < 40 or loop.scheduler.has_work():
            if submitted < 40 and rng.random() < 0.3:
                prompt = [1] + [rng.randrange(3, engine.n_vocab) for _ in range(rng.randrange(30))]
                params = SamplingParams(max_tokens=rng.randrange(2, 30), temperature=0.0)
                loop.inbox.submit(GW, Generate(f"r{submitted}", prompt, params))
                submitted += 1
            before = counter.passes
            loop.tick(block=False)
            if records and records[-1][1] == 0:
                records[-1] = (records[-1][0], counter.passes - before)
        assert records and len(decoding) == len(records)
        one_pass = 0
        for (record, passes), slots in zip(records, decoding, strict=True):
            assert record.ubatches == passes
            longest = max(MIN_BRIDGED_GAP, len(slots) // 4)
            if not record.prefill_tokens and all(b - a - 1 <= longest for a, b in pairwise(slots)):
                assert passes == 1
                one_pass += 1
        assert one_pass >= len(records) // 4  # many such ticks were checked
        assert sum(r.pad_tokens for r, _ in records) > 0  # idle slots really were bridged
    finally:
        engine.close()


# --- placement ------------------------------------------------------------------------------


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(key=(GW, request_id), prompt=prompt, params=SamplingParams(), arrived_at=0.0)


def admit(scheduler: Scheduler, *requests: Request, tick: int = 0) -> list[Slot]:
    """Admit the requests and prefill their prompts; return their slots."""
    for r in requests:
        scheduler.enqueue(r)
    admitted = scheduler.admit(tick=tick, now=0.0)
    scheduler.advance(scheduler.schedule(64, 64))
    return [a.slot for a in admitted]


def end(scheduler: Scheduler, *slots: Slot, tick: int) -> None:
    for slot in slots:
        slot.finish(FinishReason.STOP)
    scheduler.release_finished(tick=tick, now=0.0)


def streams_scheduler(n_slots: int) -> Scheduler:
    rules = SplitRules(per_slot_streams=True)
    return Scheduler(n_slots, 8, 64, min_copy_tokens=2, split_rules=rules)


def test_with_a_stream_per_slot_requests_take_slots_beside_busy_ones():
    scheduler = streams_scheduler(8)
    slots = admit(scheduler, *(request(f"r{i}", [1, 10 + i]) for i in range(4)))
    assert [slot.index for slot in slots] == [0, 1, 2, 3]
    end(scheduler, slots[1], tick=1)
    (slot,) = admit(scheduler, request("next", [1, 99]), tick=2)
    assert slot is slots[1]  # it closes the gap rather than opening one at 4


def test_with_a_stream_per_slot_a_prefix_away_from_busy_slots_is_copied_beside_them():
    scheduler = streams_scheduler(8)
    shared = [1, 2, 3, 4, 5, 6]
    a, b, _ = admit(scheduler, request("a", shared), request("b", [7]), request("c", [8]))
    end(scheduler, a, b, tick=1)  # slot 0 keeps a's prompt; only slot 2 is busy
    (d,) = admit(scheduler, request("d", [*shared, 9]), tick=2)
    assert d.index in (1, 3) and d.request.cached_tokens == len(shared)
    assert scheduler.slots[0].request is None  # the cache was copied, not taken over


def test_without_a_stream_per_slot_placement_keeps_caches_longest():
    scheduler = Scheduler(8, 8, 64)
    slots = admit(scheduler, *(request(f"r{i}", [1, 10 + i]) for i in range(3)))
    end(scheduler, slots[1], tick=1)
    (slot,) = admit(scheduler, request("next", [50]), tick=2)
    assert slot.index == 3  # least recently used, gap or not: one stream is one pass anyway
