"""Prefix-cache placement: which slot a request takes, and whose cached prefix it reuses.

Plain Python over the scheduler's slots, no model. A slot keeps the KV cells of the sequence
it ran (prompt, then generated tokens) after its request ends, so a later prompt that starts
the same way skips those tokens (prefix reuse, like llama-server's cache_prompt). place()
looks once over every slot's cached tokens and answers with a Placement: the idle slot the
request takes, and the cache it starts from (that slot's own, or a copy of another slot's).

Which idle slots may take a request depends on the KV cache's layout. With one cache shared
by all slots any idle slot will do. With a KV stream per slot, busy slots with consecutive
ids share a forward pass (ubatches.py), so a request takes an idle slot with the most busy
neighbours, and a longer prefix cached elsewhere is copied there: a stream copy costs far
less than a pass more on every tick of the request's life.

A prefix may also wait in host memory (ram_cache.py): a slot's cells are saved there when the
slot is taken for another request. The longest prefix wins, wherever it is; one found in RAM
only when it spares at least a block more than the slots can, as its restore copies the
whole saved state back.

How much of a shared prefix a request may reuse is one rule, usable_prefix().
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ...protocol.prefix_keys import MAX_ADVERTISED_KEYS, prefix_keys
from .ram_cache import RamCache, RamEntry, common_prefix


class CachedSlot(Protocol):
    """What placement reads of a slot (scheduler.Slot)."""

    index: int
    tokens: list[int]
    n_in_cache: int  # tokens[:n_in_cache] have their KV in the cache
    last_used_tick: int

    @property
    def busy(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request goes: the slot it takes, and the leading tokens it need not evaluate.

    With `source` and `ram` None those tokens are the target's own cells; otherwise the
    engine copies them from the source slot's, or restores the RAM entry into the target and
    keeps its first `reused` cells.
    """

    target: int  # the idle slot's index
    reused: int  # leading tokens of the request's sequence whose KV it reuses
    source: int | None = None  # a slot whose first `reused` cells are copied into target
    ram: RamEntry | None = None  # a host-memory entry restored into target


# ggml's CPU kernels (llama-cpp-python 0.3.36, batch-invariant engine: no repacked or tiled
# K-quant weights) compute a token's row on one of three paths, by the rows of its ubatch, and
# the three sum in different orders:
# - 1 row: the matmuls' vec_dot (llamafile's sgemm takes 2 rows and up), and from 512 KV
#   cells flash attention split across threads by KV cells (its split-KV path);
# - 2 to 63 rows: sgemm, and flash attention one query row at a time over all the cells;
# - 64 rows and up: sgemm, and flash attention in tiles of 64 query rows (GGML_FA_TILE_Q).
# Within a path a row's sums do not depend on the other rows, nor on how many there are.
FA_TILE_ROWS = 64


def usable_prefix(shared: int, n_tokens: int, chunk: int = 0) -> int:
    """How many of `shared` cached leading tokens a sequence of n_tokens may reuse.

    At least the last token is evaluated again: its logits give the next token. With `chunk`
    (the most prompt tokens a lone slot evaluates in one pass; 0: no kernel rule) the
    evaluated tail must also take the kernel paths each of its tokens took when the whole
    sequence ran from its first token, in chunks of `chunk` tokens from there: then a hit
    gives the same logits, bit for bit, as no hit. The scheduler evaluates the tail in chunks
    of `chunk` tokens from the reused prefix on, so its last chunk, the only one that may be
    shorter, must fall on the path of the rows it holds. When the last chunk of the whole
    sequence is as long a path as a full chunk (usually 64 tokens or more), a tail of 64
    tokens or more will do; otherwise the tail is part of that last chunk only (at least 2
    of it, or just the last token when it was alone), or starts on a chunk boundary.
    """
    most = max(0, min(shared, n_tokens - 1))
    if chunk <= 0 or n_tokens <= 0:
        return most
    evaluated = n_tokens - most  # at least 1
    last = (n_tokens - 1) % chunk + 1  # the tokens of the whole sequence's last chunk
    full_path = _path_floor(chunk)
    if _path_floor(last) == full_path:  # every token ran on one path
        tail = (evaluated - 1) % chunk + 1  # the tokens of the tail's last chunk
        evaluated += max(0, full_path - tail)
    elif evaluated <= last:
        evaluated = max(evaluated, _path_floor(last))
    else:  # the last chunk's tokens apart from the full chunks': from a chunk boundary
        evaluated = last + -(-(evaluated - last) // chunk) * chunk
    return n_tokens - evaluated


def _path_floor(rows: int) -> int:
    """The fewest rows of a ubatch that takes the kernel path `rows` rows take."""
    return 1 if rows <= 1 else 2 if rows < FA_TILE_ROWS else FA_TILE_ROWS


def place(
    slots: Sequence[CachedSlot],
    tokens: list[int],
    *,
    per_slot_streams: bool,
    min_copy_tokens: int,
    ram: RamCache | None = None,
    reserved: frozenset[int] = frozenset(),
    chunk: int = 0,
) -> Placement:
    """The idle slot for a sequence and the cache it starts from.

    The target is the candidate (candidate_slots) whose own cache holds the longest usable
    prefix, least recently used first among equals. When another slot holds one longer by
    min_copy_tokens or more, or the RAM cache one longer by a block or more, the least
    recently used candidate takes the request and starts from that prefix instead, keeping
    the other candidates' caches. `reserved` slots (this tick's copy sources) are no targets;
    at least one other slot must be idle (can_place). `chunk`: usable_prefix's.
    """
    candidates = candidate_slots(slots, per_slot_streams, reserved)
    candidate_ids = {slot.index for slot in candidates}
    shared = _usable_by_slot(slots, tokens, chunk)
    target = max(candidates, key=lambda slot: (shared.get(slot.index, 0), -slot.last_used_tick))
    best = Placement(target.index, shared.get(target.index, 0))
    lru = min(candidates, key=lambda slot: slot.last_used_tick)
    source, source_shared = None, 0
    for index, n_shared in shared.items():
        if index not in candidate_ids and n_shared > source_shared:
            source, source_shared = index, n_shared
    if source is not None and source_shared - best.reused >= min_copy_tokens:
        best = Placement(lru.index, source_shared, source)
    if ram is not None and ram.enabled and tokens:
        entry, n_shared = ram.longest(tokens)
        from_ram = usable_prefix(n_shared, len(tokens), chunk)
        if entry is not None and from_ram - best.reused >= ram.block_tokens:
            best = Placement(lru.index, from_ram, ram=entry)
    return best


def can_place(slots: Sequence[CachedSlot], reserved: frozenset[int] = frozenset()) -> bool:
    """Whether some idle slot may take a request (reserved ones may not)."""
    return any(not slot.busy and slot.index not in reserved for slot in slots)


def candidate_slots(
    slots: Sequence[CachedSlot], per_slot_streams: bool, reserved: frozenset[int] = frozenset()
) -> list[CachedSlot]:
    """The idle slots a request may take: any, or with a KV stream per slot those with the
    most busy neighbours (they join their neighbours' forward pass)."""
    idle = [slot for slot in slots if not slot.busy and slot.index not in reserved]
    if not per_slot_streams:
        return idle

    def busy(index: int) -> bool:
        return 0 <= index < len(slots) and slots[index].busy

    def neighbours(slot: CachedSlot) -> int:
        return busy(slot.index - 1) + busy(slot.index + 1)

    best = max(neighbours(slot) for slot in idle)
    return [slot for slot in idle if neighbours(slot) == best]


def advertised_keys(
    slots: Sequence[CachedSlot], ram: RamCache | None, limit: int = MAX_ADVERTISED_KEYS
) -> list[int]:
    """The prefix keys a worker's heartbeats advertise (protocol/prefix_keys.py): those of
    the slots' cached sequences, busy and most recently used first, then the RAM cache's,
    most recent first; each sequence's deepest keys first, at most `limit` in all."""
    ordered = sorted(slots, key=lambda slot: (not slot.busy, -slot.last_used_tick))
    sequences = [prefix_keys(slot.tokens[: slot.n_in_cache]) for slot in ordered]
    if ram is not None:
        sequences += [entry.keys for entry in reversed(list(ram))]
    keys: dict[int, None] = {}  # ordered, without repeats
    for sequence_keys in sequences:
        for key in reversed(sequence_keys):
            keys.setdefault(key)
            if len(keys) >= limit:
                return list(keys)
    return list(keys)


class AdvertisedPrefixes:
    """The cached prompts' keys for heartbeats, recomputed at most once per `every` seconds:
    routing needs no fresher view, and hashing every cached sequence each tick would cost."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._keys: tuple[int, ...] = ()
        self._at = -float("inf")

    def keys(self, slots: Sequence[CachedSlot], ram: RamCache | None) -> tuple[int, ...]:
        now = time.monotonic()
        if now - self._at >= self.every:
            self._at = now
            self._keys = tuple(advertised_keys(slots, ram))
        return self._keys


def _usable_by_slot(slots: Sequence[CachedSlot], tokens: list[int], chunk: int) -> dict[int, int]:
    """Each slot's usable cached prefix of the sequence, for the slots that cache any."""
    shared = {}
    for slot in slots:
        if slot.n_in_cache:
            common = common_prefix(slot.tokens[: slot.n_in_cache], tokens)
            n = usable_prefix(common, len(tokens), chunk)
            if n:
                shared[slot.index] = n
    return shared
