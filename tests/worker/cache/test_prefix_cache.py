"""Prefix-cache placement and the RAM cache's LRU store: pure logic, no model."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from loomserve.gateway.workers.routing import preferred_worker
from loomserve.protocol import FinishReason, SamplingParams
from loomserve.protocol.prefix_keys import prefix_keys
from loomserve.worker.cache.prefix_cache import advertised_keys, can_place, place, usable_prefix
from loomserve.worker.cache.ram_cache import RamCache
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.sched.slots import Request

BLOCK = 4


@dataclass
class FakeSlot:
    """A slot as placement reads it."""

    index: int
    tokens: list[int] = field(default_factory=list)
    n_in_cache: int = 0
    last_used_tick: int = -1
    busy: bool = False


def cached(index: int, tokens: list[int], tick: int = 0, busy: bool = False) -> FakeSlot:
    return FakeSlot(index, list(tokens), len(tokens), tick, busy)


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# --- placement ------------------------------------------------------------------------------


def test_usable_prefix_always_leaves_the_last_token_to_evaluate():
    assert usable_prefix(10, 10) == 9
    assert usable_prefix(4, 10) == 4
    assert usable_prefix(0, 1) == 0 and usable_prefix(3, 0) == 0
    assert usable_prefix(10, 10, chunk=512) == 8 and usable_prefix(1, 1, chunk=512) == 0


@pytest.mark.parametrize(
    ("shared", "n_tokens", "usable"),
    [
        (355, 355, 291),  # the audit's prompt sent again: its last 64 tokens tile alike
        (300, 355, 291),
        (200, 355, 200),  # 155 tokens evaluated: tiled anyway
        (900, 1000, 900),
        (999, 1000, 936),
        (550, 600, 536),  # a last chunk of 88: 64 of it again
        (530, 530, 528),  # a last chunk of 18 (one row at a time): 2 of it again
        (515, 520, 515),
        (500, 520, 0),  # its last chunk of 8 apart from the 512 before: from a boundary
        (1100, 1050, 1048),  # a last chunk of 26 wholly cached
        (900, 1050, 512),
        (513, 513, 512),  # a last chunk of 1 runs alone, as it did
        (500, 513, 0),
        (1030, 1040, 1030),  # 10 evaluated, all in the last chunk of 16
        (600, 1100, 600),  # 500 evaluated in one pass
        (560, 1100, 524),  # 540 would leave a last pass of 28: 576 leaves one of 64
        (500, 1100, 500),
    ],
)
def test_usable_prefix_keeps_the_tail_on_its_kernel_paths(shared, n_tokens, usable):
    assert usable_prefix(shared, n_tokens, chunk=512) == usable


def kernel_path(rows: int) -> int:
    """ggml's CPU paths by ubatch rows: 1 row; 2 to 63; 64 and up (prefix_cache.py)."""
    return 0 if rows == 1 else 1 if rows < 64 else 2


def paths_of_run(n_tokens: int, start: int, chunk: int) -> list[int]:
    """Each evaluated token's kernel path when tokens start.. run in chunks from start."""
    paths = []
    for first in range(start, n_tokens, chunk):
        rows = min(chunk, n_tokens - first)
        paths += [kernel_path(rows)] * rows
    return paths


@pytest.mark.parametrize("chunk", [1, 2, 17, 64, 100, 512])
def test_usable_prefix_is_the_longest_reuse_whose_tail_runs_as_it_did_cold(chunk):
    """Against a brute force: the longest reuse after which every token evaluated again
    takes the path it took when the whole sequence ran from its first token."""
    for n_tokens in [*range(1, 200), *range(500, 530), 1023, 1024, 1025, 1100]:
        cold = paths_of_run(n_tokens, 0, chunk)
        for shared in {0, 1, 5, 60, 63, 64, 65, 100, 512, 513, n_tokens - 2, n_tokens - 1}:
            if not 0 <= shared <= n_tokens:
                continue
            expected = next(
                start
                for start in range(min(shared, n_tokens - 1), -1, -1)
                if paths_of_run(n_tokens, start, chunk) == cold[start:]
            )
            assert usable_prefix(shared, n_tokens, chunk) == expected, (n_tokens, shared)


def test_an_idle_slots_own_cache_wins_without_a_copy():
    slots = [cached(0, seq(0, 8), tick=1), cached(1, seq(100, 8), tick=0)]
    placement = place(slots, [*seq(0, 6), 99], per_slot_streams=False, min_copy_tokens=1)
    assert (placement.target, placement.reused) == (0, 6)
    assert placement.source is None and placement.ram is None  # its own cells: nothing moved


def test_with_nothing_shared_the_least_recently_used_slot_is_taken():
    slots = [cached(0, seq(0, 8), tick=5), cached(1, seq(100, 8), tick=2)]
    placement = place(slots, [7, 7, 7], per_slot_streams=False, min_copy_tokens=1)
    assert (placement.target, placement.reused) == (1, 0)


@pytest.mark.parametrize(("min_copy_tokens", "copied"), [(3, True), (4, False)])
def test_a_busy_slots_prefix_is_copied_only_when_it_saves_enough(min_copy_tokens, copied):
    slots = [
        cached(0, seq(0, 10), busy=True),
        cached(1, seq(0, 3), tick=4),  # an idle slot with a shorter prefix of it
        cached(2, seq(50, 3), tick=1),
    ]
    placement = place(
        slots, [*seq(0, 6), 99], per_slot_streams=False, min_copy_tokens=min_copy_tokens
    )
    if copied:  # 6 shared against 3: into the least recently used idle slot
        assert (placement.target, placement.source, placement.reused) == (2, 0, 6)
    else:
        assert (placement.target, placement.source, placement.reused) == (1, None, 3)


def test_with_a_stream_per_slot_the_target_sits_beside_busy_slots():
    slots = [
        cached(0, seq(0, 4), busy=True),
        FakeSlot(1),
        FakeSlot(2),
        cached(3, seq(0, 9), tick=0),  # caches more, but far from the busy slot
    ]
    placement = place(slots, seq(0, 12), per_slot_streams=True, min_copy_tokens=2)
    assert placement.target == 1 and placement.source == 3 and placement.reused == 9


def test_reserved_slots_are_no_targets():
    slots = [cached(0, seq(0, 8), tick=0), FakeSlot(1, last_used_tick=3)]
    placement = place(
        slots, seq(0, 8), per_slot_streams=False, min_copy_tokens=1, reserved=frozenset({0})
    )
    assert placement.target == 1 and placement.source == 0
    assert can_place(slots, frozenset({0})) and not can_place(slots, frozenset({0, 1}))


def test_a_longer_prefix_in_ram_wins_over_the_slots():
    ram = RamCache(1000, block_tokens=BLOCK)
    entry = ram.put(seq(0, 20), b"state", 100)
    slots = [cached(0, seq(0, 6), tick=3), FakeSlot(1, last_used_tick=1)]
    placement = place(slots, [*seq(0, 16), 99], per_slot_streams=False, min_copy_tokens=1, ram=ram)
    assert placement.ram is entry and placement.reused == 16
    assert placement.target == 1  # the least recently used: slot 0's cache stays
    assert placement.source is None


def test_ram_must_beat_the_slots_by_a_block():
    ram = RamCache(1000, block_tokens=BLOCK)
    ram.put(seq(0, 20), b"state", 100)
    slots = [cached(0, seq(0, 13), tick=3), FakeSlot(1)]
    placement = place(slots, [*seq(0, 16), 99], per_slot_streams=False, min_copy_tokens=1, ram=ram)
    assert placement.ram is None and placement.reused == 13 and placement.target == 0


# --- the RAM cache's store --------------------------------------------------------------------


def test_the_longest_stored_prefix_is_found():
    ram = RamCache(10_000, block_tokens=BLOCK)
    short = ram.put(seq(0, 8), "s", 10)
    other = ram.put([*seq(0, 8), *seq(500, 12)], "o", 10)
    assert short is not None and other is not None
    entry, shared = ram.longest([*seq(0, 8), *seq(500, 5), 1, 2, 3])
    assert entry is other and shared == 13
    # Shares only the first block: the short entry was dropped as a prefix of `other`.
    assert len(ram) == 1
    assert ram.longest([*seq(0, 6), 999]) == (other, 6)
    assert ram.longest([*seq(0, 3), 999]) == (None, 0)  # less than a block: not worth it
    assert ram.longest(seq(700, 30)) == (None, 0)


def test_a_sequence_already_held_is_not_worth_saving():
    ram = RamCache(10_000, block_tokens=BLOCK)
    ram.put(seq(0, 12), "s", 10)
    assert ram.covers(seq(0, 12)) and ram.covers(seq(0, 9))
    assert not ram.worth_saving(seq(0, 9))
    assert ram.worth_saving(seq(0, 13))
    assert not ram.worth_saving(seq(0, 3))  # shorter than a block
    assert not RamCache(0).worth_saving(seq(0, 100))  # off


def test_entries_are_evicted_least_recently_used_first_by_bytes():
    ram = RamCache(300, block_tokens=BLOCK)
    a = ram.put(seq(0, 8), "a", 100)
    b = ram.put(seq(100, 8), "b", 100)
    c = ram.put(seq(200, 8), "c", 100)
    ram.restored(a, 6)  # a is used: b is now the least recent
    d = ram.put(seq(300, 8), "d", 150)
    assert d is not None and ram.used <= ram.capacity
    held = set(ram)
    assert a in held and d in held and b not in held and c not in held
    assert ram.stats.evictions == 2 and ram.stats.hits == 1 and ram.stats.restored_tokens == 6
    assert ram.longest(seq(100, 8)) == (None, 0)  # an evicted entry is not found any more
    assert ram.used == sum(entry.n_bytes for entry in ram)


def test_a_state_larger_than_the_budget_is_not_stored():
    ram = RamCache(100, block_tokens=BLOCK)
    assert ram.put(seq(0, 8), "x", 101) is None and ram.used == 0 and not ram.fits(101)


def test_an_entry_restored_whole_moves_into_its_slot():
    ram = RamCache(1000, block_tokens=BLOCK)
    entry = ram.put(seq(0, 8), "x", 100)
    ram.restored(entry, 5)
    assert len(ram) == 1  # the slot holds only part of it: kept
    ram.restored(entry, 8)
    assert len(ram) == 0 and ram.used == 0


def test_the_index_forgets_removed_entries():
    ram = RamCache(10_000, block_tokens=BLOCK)
    for i in range(50):
        ram.put([*seq(0, 8), *seq(1000 * (i + 1), 8)], i, 10)
    ram.clear()
    assert len(ram) == 0 and ram.used == 0 and not ram._index


# --- the scheduler's admissions ---------------------------------------------------------------


def test_a_slot_taken_for_another_prompt_has_its_cache_saved_first():
    scheduler = Scheduler(n_slots=1, max_queue=4, slot_context=128, ram_cache_bytes=1 << 20)
    scheduler.ram.block_tokens = BLOCK

    def request(name: str, prompt: list[int]) -> Request:
        return Request((b"gw", name), prompt, SamplingParams(max_tokens=4), arrived_at=0.0)

    def serve(name: str, prompt: list[int], tick: int):
        scheduler.enqueue(request(name, prompt))
        (admission,) = scheduler.admit(tick=tick, now=0.0)
        scheduler.advance(scheduler.schedule(256, 256))
        admission.slot.finish(FinishReason.STOP)
        scheduler.release_finished(tick=tick, now=0.0)
        return admission

    first = serve("a", seq(0, 12), tick=0)
    assert first.save_first is None  # nothing cached yet
    second = serve("b", seq(100, 12), tick=1)
    assert second.save_first == seq(0, 12)  # a's cells, about to be overwritten
    scheduler.ram.put(second.save_first, b"a-state", 10)  # as the loop does
    third = serve("c", [*seq(0, 12), 7, 8], tick=2)
    assert third.ram_entry is not None and third.reused == 12
    assert third.save_first == seq(100, 12)
    assert third.request.cached_tokens == 12


# --- routing: what heartbeats advertise -------------------------------------------------------


def test_prefix_keys_cover_doubling_whole_blocks_and_are_stable():
    tokens = seq(0, 300)
    keys = prefix_keys(tokens)
    assert len(keys) == 3  # 64, 128 and 256 tokens; 512 is more than it has
    assert keys == prefix_keys([*tokens, 5, 6])  # only whole prefixes count
    assert prefix_keys(seq(0, 63)) == []
    assert prefix_keys([*seq(0, 128), 1]) == keys[:2]
    assert prefix_keys([9, *seq(1, 299)])[0] != keys[0]
    assert all(0 <= key < 2**63 for key in keys)  # an int64 on the wire
    # The same in every process: a digest, not Python's per-process hash.
    code = "from loomserve.protocol.prefix_keys import prefix_keys; print(prefix_keys(range(300)))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert other.stdout.strip() == str(keys)


def test_a_worker_advertises_its_slots_then_its_ram_deepest_keys_first():
    ram = RamCache(10_000, block_tokens=BLOCK)
    old = ram.put(seq(1000, 128), "old", 10)
    new = ram.put(seq(2000, 64), "new", 10)
    slots = [cached(0, seq(0, 256), tick=1), cached(1, seq(500, 64), busy=True)]
    keys = advertised_keys(slots, ram)
    assert keys == [
        *prefix_keys(seq(500, 64)),  # busy first
        *reversed(prefix_keys(seq(0, 256))),
        *new.keys,
        *reversed(old.keys),
    ]
    assert advertised_keys(slots, ram, limit=3) == keys[:3]


def test_routing_prefers_the_worker_advertising_the_deepest_key():
    system = seq(0, 64)  # a system prompt every conversation shares: the first block
    mine = [*system, *seq(100, 200)]
    keys = prefix_keys(mine)
    advertised = {
        "a": prefix_keys([*system, *seq(900, 200)]),  # another conversation, same system
        "b": prefix_keys(mine[:130]),  # this conversation's history
    }
    assert preferred_worker("a", keys, advertised) == "b"
    # Only the first block is advertised anywhere: the gateway's own record is fresher.
    assert preferred_worker("c", keys, {"a": advertised["a"]}) == "c"
    assert preferred_worker(None, keys, {"a": advertised["a"]}) == "a"
    assert preferred_worker(None, keys, {}) is None
