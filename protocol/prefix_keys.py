"""Keys of cached prompt prefixes, so a worker can tell gateways which prompts it holds.

The worker lists the keys of the sequences it caches (in slots and in its RAM cache) in its
Heartbeat; a gateway computes the keys of a new prompt with the same function and prefers a
worker that advertises one of them, the deepest first. Pure, like vocab.py: the two peers
share this function and nothing else.

A sequence has a key for each prefix of 1, 2, 4, 8, ... blocks of PREFIX_KEY_BLOCK tokens
that it holds whole: a handful of keys however long it is, and a prompt that shares at least
half of a cached sequence's length finds a key of it. Conversations that share a system
prompt share their shallow keys and differ in the deep ones.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

PREFIX_KEY_BLOCK = 64  # tokens; a shorter prefix is too little to route for
MAX_ADVERTISED_KEYS = 256  # keys in one Heartbeat (2 KiB at most)


def prefix_keys(tokens: Sequence[int]) -> list[int]:
    """The keys of tokens' prefixes of 1, 2, 4, ... whole blocks, shallowest first.

    Each key is the first 8 bytes of a BLAKE2b digest of the prefix's token ids: the same in
    every process and on every machine, unlike Python's hash().
    """
    keys = []
    depth = PREFIX_KEY_BLOCK
    digest = hashlib.blake2b(digest_size=8)
    done = 0
    while depth <= len(tokens):
        # One running digest: each deeper key hashes only the tokens it adds.
        digest.update(array("i", tokens[done:depth]).tobytes())
        keys.append(int.from_bytes(digest.copy().digest(), "little") >> 1)  # fits int64
        done, depth = depth, depth * 2
    return keys
