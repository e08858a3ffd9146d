"""The host-memory prompt cache (`--cache-ram`): slots' KV states kept in RAM after the slots
were taken for other requests, found again by the prompts that start with them.

Plain Python, no model: a state is opaque bytes that the engine saved (llama_state_seq_get_data)
and will restore (llama_state_seq_set_data). Entries are kept least recently used first and
evicted by bytes, so the cache never holds more than its capacity.

Finding the longest stored prefix of a prompt does not compare the prompt with every entry.
Each entry is indexed by chained hashes of its block-aligned prefixes (BLOCK_TOKENS tokens a
block, as vLLM's and SGLang's prefix caches key their blocks): the prompt's chain is followed
while some entry shares it, and only the entries that share the deepest block are compared
token by token (which also makes a hash collision harmless). A prefix shorter than one block
is not worth a restore, and is never found.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import count

from ...protocol.prefix_keys import prefix_keys

BLOCK_TOKENS = 32


# A sequence's KV state as the engine saved it (llama_state_seq_get_data); opaque here.
SavedState = bytes | bytearray


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, by bisection over C-speed slice comparisons."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(slots=True, eq=False)
class RamEntry:
    """One saved sequence: its tokens and the KV state of exactly those tokens."""

    id: int
    tokens: list[int]
    state: SavedState
    n_bytes: int
    hashes: list[int] = field(default_factory=list)  # chained block hashes, for the index
    keys: list[int] = field(default_factory=list)  # its prefix keys, for heartbeats


@dataclass(slots=True)
class RamCacheStats:
    """Counters since start-up, read at scrape time."""

    hits: int = 0  # admissions that restored an entry
    restored_tokens: int = 0  # prompt tokens those restores spared from evaluation
    saves: int = 0  # entries stored
    evictions: int = 0  # entries dropped to make room


class RamCache:
    """A bounded LRU store of saved sequences, looked up by longest shared prefix."""

    def __init__(self, capacity_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        self.capacity = max(0, capacity_bytes)
        self.block_tokens = block_tokens
        self.used = 0
        self.stats = RamCacheStats()
        self._entries: OrderedDict[int, RamEntry] = OrderedDict()  # least recent first
        self._index: dict[int, set[int]] = {}  # chain hash of k blocks -> ids of entries
        self._ids = count()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[RamEntry]:
        return iter(self._entries.values())

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    # --- look-ups -----------------------------------------------------------------------

    def longest(self, tokens: list[int]) -> tuple[RamEntry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and how long; (None, 0) when
        none shares a whole block."""
        candidates = self._deepest(tokens)
        best, best_shared = None, 0
        for entry_id in candidates:
            entry = self._entries[entry_id]
            shared = common_prefix(entry.tokens, tokens)
            if shared > best_shared or (shared == best_shared and best and entry.id > best.id):
                best, best_shared = entry, shared
        if best_shared < self.block_tokens:
            return None, 0
        return best, best_shared

    def covers(self, tokens: list[int]) -> bool:
        """Whether an entry holds this whole sequence already (as itself or a prefix)."""
        _, shared = self.longest(tokens)
        return shared == len(tokens)

    def worth_saving(self, tokens: list[int]) -> bool:
        """Whether a sequence is long enough to keep and not held already."""
        return self.enabled and len(tokens) >= self.block_tokens and not self.covers(tokens)

    def fits(self, n_bytes: int) -> bool:
        """Whether a state of n_bytes can be stored at all (evicting others if need be)."""
        return 0 < n_bytes <= self.capacity

    # --- changes ------------------------------------------------------------------------

    def put(self, tokens: list[int], state: SavedState, n_bytes: int) -> RamEntry | None:
        """Store a saved sequence as the most recent entry; None when it cannot fit.

        Entries whose tokens are a prefix of the new one are dropped: every prompt that
        would find them finds at least as much in it. Then the least recently used entries
        are evicted until it fits.
        """
        if not self.fits(n_bytes) or len(tokens) < self.block_tokens:
            return None
        hashes = self._chain(tokens)
        for entry_id in self._sharing(hashes):
            entry = self._entries[entry_id]
            if len(entry.tokens) <= len(tokens) and tokens[: len(entry.tokens)] == entry.tokens:
                self.remove(entry)
        while self.used + n_bytes > self.capacity:
            _, oldest = next(iter(self._entries.items()))
            self.remove(oldest)
            self.stats.evictions += 1
        entry = RamEntry(next(self._ids), list(tokens), state, n_bytes, hashes, prefix_keys(tokens))
        self._entries[entry.id] = entry
        for h in hashes:
            self._index.setdefault(h, set()).add(entry.id)
        self.used += n_bytes
        self.stats.saves += 1
        return entry

    def restored(self, entry: RamEntry, n_tokens: int) -> None:
        """An admission restored `entry` and kept its first n_tokens.

        A slot that now holds the whole entry makes it redundant (the slot is saved again,
        longer, when it is taken); otherwise it becomes the most recent entry.
        """
        self.stats.hits += 1
        self.stats.restored_tokens += n_tokens
        if entry.id not in self._entries:
            return
        if n_tokens >= len(entry.tokens):
            self.remove(entry)
        else:
            self._entries.move_to_end(entry.id)

    def remove(self, entry: RamEntry) -> None:
        if self._entries.pop(entry.id, None) is None:
            return
        self.used -= entry.n_bytes
        for h in entry.hashes:
            ids = self._index.get(h)
            if ids is not None:
                ids.discard(entry.id)
                if not ids:
                    del self._index[h]

    def clear(self) -> None:
        for entry in list(self._entries.values()):
            self.remove(entry)

    # --- the block index ------------------------------------------------------------------

    def _chain(self, tokens: list[int]) -> list[int]:
        """Hashes of tokens' whole-block prefixes: the k-th covers the first k+1 blocks."""
        block, hashes, h = self.block_tokens, [], 0
        for start in range(0, len(tokens) - block + 1, block):
            h = hash((h, tuple(tokens[start : start + block])))
            hashes.append(h)
        return hashes

    def _deepest(self, tokens: list[int]) -> set[int]:
        """The entries that share the most whole blocks with `tokens`."""
        block, index, h = self.block_tokens, self._index, 0
        found: set[int] = set()
        for start in range(0, len(tokens) - block + 1, block):
            h = hash((h, tuple(tokens[start : start + block])))
            ids = index.get(h)
            if not ids:
                break
            found = ids
        return set(found)

    def _sharing(self, hashes: list[int]) -> set[int]:
        """Every entry that shares at least one whole block with the chain."""
        found: set[int] = set()
        for h in hashes:
            ids = self._index.get(h)
            if not ids:
                break
            found |= ids
        return found
