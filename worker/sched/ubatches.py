"""How many forward passes (ubatches) llama.cpp makes of one tick's batch; plain Python.

llama_decode cuts a batch into ubatches, and every ubatch is a full forward pass that reads
all the weights again. With one KV stream (a unified cache) it cuts by size alone
(`split_simple`): a batch within n_ubatch tokens is one pass. With a stream per slot (batch
invariance) it must cut with `split_equal(n_ubatch, sequential=true)` (llama-batch.cpp, from
llama_kv_cache::init_batch): starting at the first unused token it gathers a chain of
*consecutive* sequence ids, each found after the previous one in batch order, and takes the
same number of tokens from each: the fewest any of them has left, capped at n_ubatch / chain
length. So a gap in the slot ids, or a prompt chunk beside decode tokens, costs a pass.

count_ubatches replays that on runs (one slot's consecutive tokens each); the tests pin it to
the passes the real engine makes. The scheduler places new requests beside busy slots, and
shaping.py orders runs by slot id and bridges short gaps with padding tokens (gaps_to_bridge),
so a tick costs one pass for its decode tokens plus one per prompt chunk (fewer when
neighbouring slots prefill chunks of one length).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise


def count_ubatches(runs: Sequence[tuple[int, int]], n_ubatch: int, per_seq_streams: bool) -> int:
    """The ubatches llama.cpp makes of a batch of `runs`, (sequence id, tokens) in batch
    order, each sequence in one run; per_seq_streams: each sequence has its own KV stream."""
    if not runs:
        return 0
    n_tokens = sum(n for _, n in runs)
    if not per_seq_streams:
        return -(-n_tokens // n_ubatch)  # split_simple: by size alone
    seqs = [seq for seq, _ in runs]
    left = [n for _, n in runs]
    if max(left) == 1 and seqs == list(range(seqs[0], seqs[0] + len(seqs))):
        return 1  # the common tick: one decode token per slot, slots in a row
    position = {seq: i for i, seq in enumerate(seqs)}
    n_runs, ubatches, first = len(runs), 0, 0
    while True:
        while first < n_runs and not left[first]:
            first += 1  # the first run with tokens left: its tokens come first in the batch
        if first == n_runs:
            return ubatches
        # The chain: seq, seq + 1, ... while the next id has tokens left later in the batch.
        chain, last, seq = [first], first, seqs[first]
        while len(chain) <= n_ubatch:
            seq += 1
            # In slot order the next id is the next run; otherwise look it up.
            following = (
                last + 1 if last + 1 < n_runs and seqs[last + 1] == seq else position.get(seq)
            )
            if following is None or following < last or not left[following]:
                break
            chain.append(following)
            last = following
        take = min(min([left[i] for i in chain]), max(1, n_ubatch // len(chain)))
        for i in chain:
            left[i] -= take
        ubatches += 1


# A pad token costs one token's compute; bridging a gap saves a whole pass. A gap is bridged
# when it adds at most a quarter to the batch's sequences, or at most this many slots.
MIN_BRIDGED_GAP = 4


@dataclass(frozen=True, slots=True)
class SplitRules:
    """How llama.cpp cuts this engine's batches, and what the scheduler may do about it."""

    per_slot_streams: bool = False  # a KV stream per slot: batches are cut by sequence
    # Padding needs a cache that can drop one cell again (not a recurrent state).
    padding: bool = True
    # Whether an idle slot's cached prefix survives a padding token that is removed after the
    # pass. Not with a sliding-window cache: the pad may take a cell the prefix still needs.
    pad_cached_slots: bool = True
    # The most prompt tokens a lone slot evaluates in one pass, when a prefix hit must give
    # the logits no hit gives, bit for bit (prefix_cache.usable_prefix); 0: no such promise.
    prompt_chunk: int = 0


def gaps_to_bridge(in_batch: Sequence[int], can_pad: Callable[[int], bool], room: int) -> list[int]:
    """The slot ids to pad with one token each so that the sorted ids `in_batch` run with
    fewer gaps: whole gaps that can all be padded and are short (MIN_BRIDGED_GAP), shortest
    first, within `room` tokens."""
    longest = max(MIN_BRIDGED_GAP, len(in_batch) // 4)
    gaps = []
    for low, high in pairwise(in_batch):
        missing = range(low + 1, high)
        if 0 < len(missing) <= longest and all(can_pad(seq) for seq in missing):
            gaps.append(missing)
    pads: list[int] = []
    for missing in sorted(gaps, key=len):
        if len(missing) > room:
            break
        pads.extend(missing)
        room -= len(missing)
    return sorted(pads)
