"""The routing policy, endpoint expansion and the pool's set of workers, without an engine.

Tests on real workers are in test_replicas.py.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from loomserve.gateway.config import GatewayConfig
from loomserve.gateway.endpoints import expand, needs_resolving, split_tcp, tcp_endpoint
from loomserve.gateway.workers.directory import OneVocabulary
from loomserve.gateway.workers.pool import WorkerPool
from loomserve.gateway.workers.routing import (
    AFFINITY_SLACK,
    PREFIX_BLOCK_TOKENS,
    PrefixAffinity,
    WorkerLoad,
    choose_worker,
    prefix_key,
)
from loomserve.protocol.messages import Load


def load(endpoint: str, free: int, queued: int = 0, pending: int = 0, slots: int = 8, open_=0):
    return WorkerLoad(endpoint, slots, Load(queued, free, slots - free), pending, open_)


# --- headroom and choice -----------------------------------------------------------------


def test_headroom_counts_free_slots_queue_and_what_the_heartbeat_cannot_know() -> None:
    assert load("a", free=4).headroom == 4
    assert load("a", free=4, queued=1, pending=2).headroom == 1
    assert load("a", free=0, queued=3).headroom == -3
    # This gateway alone keeps 7 of 8 slots busy, whatever an older heartbeat said.
    assert load("a", free=8, open_=7).headroom == 1


def test_the_most_headroom_wins_and_ties_go_to_the_first() -> None:
    loads = [load("a", free=2), load("b", free=5), load("c", free=5)]
    choice = choose_worker(loads, preferred=None)
    assert (choice.endpoint, choice.affinity) == ("b", False)
    assert (
        choose_worker([load("a", free=0, queued=2), load("b", free=0, queued=1)], None).endpoint
        == "b"
    )
    with pytest.raises(ValueError):
        choose_worker([], None)


def test_affinity_holds_while_the_preferred_worker_is_not_much_busier() -> None:
    best = load("b", free=6)
    within = load("a", free=6 - AFFINITY_SLACK)
    beyond = load("a", free=6 - AFFINITY_SLACK - 1)
    assert choose_worker([within, best], preferred="a").endpoint == "a"
    assert choose_worker([within, best], preferred="a").affinity
    assert choose_worker([beyond, best], preferred="a").endpoint == "b"
    # A preferred worker that is gone from the candidates is simply not chosen.
    assert choose_worker([best], preferred="a").endpoint == "b"


def test_affinity_never_queues_a_request_that_a_free_slot_elsewhere_could_start() -> None:
    full = load("a", free=0)
    assert choose_worker([full, load("b", free=1)], preferred="a").endpoint == "b"
    # When every worker would queue it, the cached prefix is worth the (similar) wait.
    queued = load("a", free=0, queued=1)
    assert choose_worker([queued, load("b", free=0)], preferred="a").endpoint == "a"


def test_prefix_key_is_the_first_block_only() -> None:
    prompt = list(range(PREFIX_BLOCK_TOKENS))
    assert prefix_key(prompt[:-1]) is None
    assert prefix_key(prompt) == prefix_key([*prompt, 1, 2, 3])
    assert prefix_key(prompt) != prefix_key([7, *prompt[1:]])


def test_prefix_affinity_is_a_bounded_lru() -> None:
    affinity = PrefixAffinity(capacity=2)
    affinity.record(1, "a")
    affinity.record(2, "b")
    affinity.record(1, "b")  # 1 is now the most recent, served by b
    affinity.record(3, "a")  # 2 is the least recent: dropped
    assert (affinity.owner(1), affinity.owner(2), affinity.owner(3)) == ("b", None, "a")
    assert len(affinity) == 2
    affinity.record(None, "a")  # a prompt without a key leaves no trace
    assert affinity.owner(None) is None and len(affinity) == 2
    affinity.forget_worker("b")
    assert (affinity.owner(1), affinity.owner(3)) == (None, "a")


# --- endpoints ---------------------------------------------------------------------------


def test_endpoints_that_stand_for_themselves() -> None:
    for endpoint in ("tcp://10.0.0.7:5555", "tcp://[::1]:5555", "ipc:///tmp/w.ipc"):
        assert expand(endpoint) == [endpoint]
        assert not needs_resolving(endpoint)
    assert needs_resolving("tcp://worker:5555")
    assert split_tcp("tcp://[fe80::1]:9") == ("fe80::1", 9)
    assert tcp_endpoint("fe80::1", 9) == "tcp://[fe80::1]:9"
    for bad in ("tcp://worker", "tcp://worker:http"):
        with pytest.raises(ValueError):
            split_tcp(bad)
    with pytest.raises(ValueError):
        GatewayConfig(model_path=Path("m.gguf"), worker_endpoints=("tcp://no-port",))
    with pytest.raises(ValueError):
        GatewayConfig(model_path=Path("m.gguf"), worker_endpoints=())


def test_a_name_means_every_address_it_resolves_to() -> None:
    addresses = {info[4][0] for info in socket.getaddrinfo("localhost", 5555)}
    expanded = expand("tcp://localhost:5555")
    assert "tcp://127.0.0.1:5555" in expanded
    assert len(expanded) == len(addresses)  # one each, duplicates (per protocol) merged
    with pytest.raises(OSError):
        expand("tcp://no-such-host.invalid:5555")


# --- the pool's set of workers -------------------------------------------------------------


def test_the_pool_follows_the_resolved_addresses() -> None:
    """Addresses that appear get a connection; vanished ones are retired, then closed."""
    answers: dict[str, list[str] | Exception] = {"tcp://workers:5555": ["tcp://10.9.0.1:5555"]}

    def resolver(endpoint: str) -> list[str]:
        answer = answers[endpoint]
        if isinstance(answer, Exception):
            raise answer
        return answer

    config = GatewayConfig(
        model_path=Path("m.gguf"), worker_endpoints=("tcp://workers:5555", "tcp://10.9.0.9:5555")
    )

    async def scenario() -> None:
        pool = WorkerPool(config, OneVocabulary("m", 100, "fingerprint"), resolver=resolver)
        answers["tcp://10.9.0.9:5555"] = ["tcp://10.9.0.9:5555"]
        await pool.resolve()
        assert list(pool.members) == ["tcp://10.9.0.1:5555", "tcp://10.9.0.9:5555"]
        assert pool.counts() == (0, 2)
        assert "none of the 2 workers" in (pool.unavailable_reason() or "")

        answers["tcp://workers:5555"] = ["tcp://10.9.0.2:5555", "tcp://10.9.0.3:5555"]
        await pool.resolve()
        assert pool.members["tcp://10.9.0.1:5555"].retiring
        assert pool.counts() == (0, 3)
        await pool.watch()  # no open requests: the retired connection closes
        assert "tcp://10.9.0.1:5555" not in pool.members

        # A DNS hiccup keeps the workers we know; a name that is gone means no workers.
        answers["tcp://workers:5555"] = socket.gaierror(socket.EAI_AGAIN, "try again")
        await pool.resolve()
        assert not pool.members["tcp://10.9.0.2:5555"].retiring
        answers["tcp://workers:5555"] = socket.gaierror(socket.EAI_NONAME, "no such name")
        await pool.resolve()
        assert pool.members["tcp://10.9.0.2:5555"].retiring
        answers["tcp://workers:5555"] = ["tcp://10.9.0.2:5555"]
        await pool.resolve()  # back before it was closed: it serves again
        assert not pool.members["tcp://10.9.0.2:5555"].retiring
        identities = {member.client.identity for member in pool.members.values()}
        assert all(identity.startswith(pool.identity + "-") for identity in identities)
        assert len(identities) == len(pool.members)
        await pool.close()

    asyncio.run(scenario())


def test_a_pool_without_any_address_says_why() -> None:
    config = GatewayConfig(model_path=Path("m.gguf"), worker_endpoints=("tcp://gone.invalid:5555",))

    def resolver(endpoint: str) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    async def scenario() -> str | None:
        pool = WorkerPool(config, OneVocabulary("m", 100, "fingerprint"), resolver=resolver)
        await pool.resolve()
        reason = pool.unavailable_reason()
        assert pool.info is None and pool.load is None
        await pool.close()
        return reason

    reason = asyncio.run(scenario())
    assert reason and "tcp://gone.invalid:5555" in reason and "not known" in reason
