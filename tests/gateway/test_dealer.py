"""The gateway's Dealer reads its socket where the event loop sees it readable: every message
arrives, in order, including those that came before it was made, those of a burst longer than
one turn, and those whose edge a send on the same socket took (libzmq's ZMQ_FD signals
edges). Raw ROUTER peer, in process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
import zmq.asyncio

from loomserve.gateway.config import GatewayConfig
from loomserve.gateway.workers.dealer import DRAIN_TURN, Dealer, open_dealer
from loomserve.protocol import Ping, decode, encode

WAIT_SECONDS = 2.0  # far above a message's time on loopback


def router(tmp_path: Path) -> tuple[zmq.Socket, str]:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/worker.ipc"
    sock.bind(endpoint)
    return sock, endpoint


def dealer_on(context: zmq.asyncio.Context, endpoint: str, received: list[object]) -> Dealer:
    config = GatewayConfig(model_path=Path("m.gguf"), worker_endpoints=(endpoint,))
    sock, monitor = open_dealer(context, config, endpoint, "gw-test")
    # Unread, the monitor's events would fill its pipe and stall libzmq's IO thread.
    sock.disable_monitor()
    monitor.close(linger=0)
    return Dealer(sock, lambda frames: received.append(decode(frames)))


async def connected(
    context: zmq.asyncio.Context, endpoint: str, peer: zmq.Socket, received: list[object]
) -> Dealer:
    """A Dealer whose first Ping the peer has seen: the connection is up both ways."""
    dealer = dealer_on(context, endpoint, received)
    for _ in range(int(WAIT_SECONDS * 100)):
        if dealer.send(Ping(0.0)):  # False until connected (IMMEDIATE)
            break
        await asyncio.sleep(0.01)
    assert peer.poll(int(WAIT_SECONDS * 1000))
    peer.recv_multipart()
    return dealer


async def until(condition, seconds: float = WAIT_SECONDS) -> None:
    for _ in range(int(seconds * 1000)):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("not within the time")


def test_a_burst_arrives_whole_in_order_and_yields_between_turns(tmp_path: Path):
    peer, endpoint = router(tmp_path)
    count = 3 * DRAIN_TURN + 7
    order: list[str] = []

    async def scenario() -> list[object]:
        context = zmq.asyncio.Context()
        received: list[object] = []
        dealer = await connected(context, endpoint, peer, received)
        for n in range(count):
            peer.send_multipart([b"gw-test", *encode(Ping(float(n)))])
        # Another callback gets its turn before the burst is all handled.
        asyncio.get_running_loop().call_later(
            0.001, lambda: order.append(f"callback after {len(received)}")
        )
        await until(lambda: len(received) == count)
        dealer.close()
        context.destroy(linger=0)
        return received

    received = asyncio.run(scenario())
    peer.close(linger=0)
    assert [message.sent_at for message in received] == [float(n) for n in range(count)]
    assert order and order[0] != f"callback after {count}"


def test_messages_whose_edge_a_send_took_still_arrive(tmp_path: Path):
    """The peer answers each Ping at once: its answer lands while the Dealer sends the next
    one, whose send may take the edge that announced it."""
    peer, endpoint = router(tmp_path)

    async def scenario() -> int:
        context = zmq.asyncio.Context()
        received: list[object] = []
        dealer = await connected(context, endpoint, peer, received)
        for n in range(300):
            peer.send_multipart([b"gw-test", *encode(Ping(float(n)))])
            while peer.poll(0):  # the Dealer's sends, read so that they never back up
                peer.recv_multipart()
            dealer.send(Ping(float(n)))
            await until(lambda expected=n + 1: len(received) == expected)
        dealer.close()
        context.destroy(linger=0)
        return len(received)

    assert asyncio.run(scenario()) == 300
    peer.close(linger=0)


def test_a_send_without_a_connected_worker_queues_nothing(tmp_path: Path):
    async def scenario() -> bool:
        context = zmq.asyncio.Context()
        dealer = dealer_on(context, f"ipc://{tmp_path}/nobody.ipc", [])
        sent = dealer.send(Ping(0.0))
        dealer.close()
        context.destroy(linger=0)
        return sent

    assert asyncio.run(scenario()) is False
