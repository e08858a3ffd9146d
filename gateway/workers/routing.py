"""Which worker gets a request: the most headroom, or the one whose cache holds its prefix.

Pure policy, no sockets: WorkerPool (pool.py) builds a WorkerLoad per live worker from its
heartbeats and calls choose_worker. A worker's headroom is what it could still start now:

    headroom = min(load.free_slots - load.queue_depth - pending, slots - open)

where load is the Load of its latest Heartbeat, pending counts this gateway's
requests to it that were sent after that heartbeat and are still open (the heartbeat cannot
know of them), and open counts all of this gateway's open requests on it: a heartbeat a
moment old must not make a worker look emptier than this gateway alone keeps it.

Prefix affinity: a worker keeps the KV cells of the prompts it served, so a request whose
prompt starts like a recent one is cheaper where that one ran. The key is a hash of the first
PREFIX_BLOCK_TOKENS prompt tokens (shorter prompts have no key: too little to gain), and
PrefixAffinity remembers, for the most recent keys, which worker served them last. That
worker is preferred while it is "not much busier" than the best: its headroom is at most
AFFINITY_SLACK below the best one's, and it has room to start the request now whenever some
other worker does (a request never waits in a queue to save a prefill that a free slot
elsewhere could do at once).

Workers also advertise what they cache, slots and RAM cache alike, as prefix keys in their
heartbeats (protocol/prefix_keys.py): keys of 1, 2, 4, ... blocks of a sequence. The worker
that advertises the deepest key of a prompt is preferred when that key is deeper than
this gateway's own (whose record is fresher but knows only the first block, which every
conversation with the same system prompt shares); otherwise the gateway's own record first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...protocol.messages import Load

PREFIX_BLOCK_TOKENS = 64  # prompt tokens hashed into the affinity key
AFFINITY_SLACK = 2  # requests the preferred worker may be behind the least-loaded one
AFFINITY_ENTRIES = 4096  # prefix keys remembered, least recently used dropped first


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One live worker's load, as the gateway knows it: its own, as its latest heartbeat told,
    and this gateway's requests on it."""

    endpoint: str
    slots: int  # from its ModelInfo
    load: Load  # from its latest heartbeat
    pending: int = 0  # this gateway's open requests on it, sent after that heartbeat
    open: int = 0  # all of this gateway's open requests on it

    @property
    def headroom(self) -> int:
        """Requests it could still start at once; negative when requests would wait."""
        waiting = self.load.queue_depth + self.pending
        return min(self.load.free_slots - waiting, self.slots - self.open)


@dataclass(frozen=True, slots=True)
class Choice:
    """Where a request goes, and whether prefix affinity sent it there."""

    endpoint: str
    affinity: bool  # it went to the worker that last served its prefix


def prefix_key(prompt: Sequence[int]) -> int | None:
    """The affinity key of a prompt: a hash of its first block; None for a shorter prompt."""
    if len(prompt) < PREFIX_BLOCK_TOKENS:
        return None
    return hash(tuple(prompt[:PREFIX_BLOCK_TOKENS]))


def choose_worker(
    loads: Sequence[WorkerLoad], preferred: str | None, slack: int = AFFINITY_SLACK
) -> Choice:
    """The worker for a request: `preferred` while not much busier, else the most headroom.

    Among equals the first in `loads` wins: the caller shuffles them to spread ties.
    """
    if not loads:
        raise ValueError("no worker to choose from")
    best = max(loads, key=lambda load: load.headroom)
    if preferred is not None:
        for load in loads:
            if load.endpoint != preferred:
                continue
            close_enough = load.headroom >= best.headroom - slack
            can_start = load.headroom > 0 or best.headroom <= 0
            if close_enough and can_start:
                return Choice(load.endpoint, affinity=True)
    return Choice(best.endpoint, affinity=False)


def preferred_worker(
    own: str | None, keys: Sequence[int], advertised: Mapping[str, Sequence[int]]
) -> str | None:
    """The worker a prompt prefers: the one advertising its deepest prefix key when that is
    deeper than the first block, else `own` (this gateway's record), else any advertiser.

    keys: the prompt's prefix_keys, shallowest first; advertised: each live worker's keys.
    """
    first_block_owner = None
    for depth in range(len(keys) - 1, -1, -1):
        key = keys[depth]
        for endpoint, prefixes in advertised.items():
            if key in prefixes:
                if depth > 0:
                    return endpoint
                first_block_owner = endpoint
                break
    return own or first_block_owner


class PrefixAffinity:
    """Which worker last served each recent prompt prefix: a bounded LRU map."""

    def __init__(self, capacity: int = AFFINITY_ENTRIES) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._owners: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, key: int | None) -> str | None:
        """The worker that last served this prefix, if it is still remembered."""
        if key is None:
            return None
        return self._owners.get(key)

    def record(self, key: int | None, endpoint: str) -> None:
        """Remember that `endpoint` served this prefix now; forget the oldest past capacity."""
        if key is None:
            return
        self._owners[key] = endpoint
        self._owners.move_to_end(key)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def forget_worker(self, endpoint: str) -> None:
        """Drop every prefix a worker served (it is gone, and its cache with it)."""
        for key in [k for k, owner in self._owners.items() if owner == endpoint]:
            del self._owners[key]
