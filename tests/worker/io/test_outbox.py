"""The loop's sends and the IO thread's share one ROUTER: the loop sends its Outputs on its own
thread while the IO thread answers a gateway, and no message waits for a wake-up that a send
on the other thread took (libzmq's ZMQ_FD signals edges). In process, raw ZeroMQ peer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from loomserve.protocol import (
    PROTOCOL_VERSION,
    Heartbeat,
    Hello,
    ModelInfo,
    Outputs,
    Ping,
    TokenChunk,
    decode,
    encode,
)
from loomserve.worker.config import WorkerConfig
from loomserve.worker.io.channels import Inbox, StatsBoard
from loomserve.worker.io.sockets import WorkerIO

SLOTS = 4
ANSWER_SECONDS = 2.0  # far above an answer's time; far below the IO thread's own timers
INFO = ModelInfo(PROTOCOL_VERSION, "tiny", 256, 512, 512, SLOTS, "fingerprint", True)


@pytest.fixture
def worker_io(tmp_path: Path) -> Iterator[WorkerIO]:
    # Heartbeats and silence checks a minute apart: the IO thread wakes for messages only.
    config = WorkerConfig(
        model_path=tmp_path / "model.gguf",
        slots=SLOTS,
        bind=f"ipc://{tmp_path}/worker.ipc",
        heartbeat_interval=60.0,
        gateway_timeout=600.0,
    )
    io = WorkerIO(config, INFO, Inbox(), StatsBoard(SLOTS))
    io.start()
    yield io
    io.close()


@pytest.fixture
def gateway(worker_io: WorkerIO) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"gw-test")
    sock.connect(worker_io.endpoint)
    sock.send_multipart(encode(Hello("gw-test")))
    assert isinstance(next_message(sock), ModelInfo)
    yield sock
    sock.close(linger=0)


def next_message(sock: zmq.Socket) -> object:
    assert sock.poll(int(ANSWER_SECONDS * 1000)), "no message within the time"
    return decode(sock.recv_multipart())


def chunk(n: int) -> Outputs:
    return Outputs(tokens=[TokenChunk("request", [n], seq=n)], finishes=[])


def test_a_flush_on_the_loop_thread_sends_at_once(worker_io: WorkerIO, gateway: zmq.Socket):
    """With the socket free, flush sends on the calling thread; while another thread holds
    the socket, flush returns at once and leaves the message to the end of that turn."""
    blocked = threading.Event()
    release = threading.Event()

    def hold_the_io_thread() -> None:
        # The IO thread's turn is what a flush must not wait for: stand in for it.
        with worker_io._lock:
            blocked.set()
            release.wait(ANSWER_SECONDS)

    worker_io.outbox.send(b"gw-test", chunk(0))
    worker_io.outbox.flush()
    assert next_message(gateway) == chunk(0)
    holder = threading.Thread(target=hold_the_io_thread)
    holder.start()
    assert blocked.wait(ANSWER_SECONDS)
    worker_io.outbox.send(b"gw-test", chunk(1))
    worker_io.outbox.flush()  # returns at once: the lock is taken
    assert not gateway.poll(100)
    release.set()
    holder.join()
    assert next_message(gateway) == chunk(1)


def test_pings_and_the_loops_outputs_cross_without_a_lost_wake_up(
    worker_io: WorkerIO, gateway: zmq.Socket
):
    """A Ping arriving as the loop sends: the send may take the edge that announced the Ping,
    and only a wake-up from the flush gets it answered before the IO thread's next timer (a
    minute here)."""
    for n in range(300):
        gateway.send_multipart(encode(Ping(float(n))))
        worker_io.outbox.send(b"gw-test", chunk(n))
        worker_io.outbox.flush()
        got: dict[type, object] = {}
        deadline = time.monotonic() + ANSWER_SECONDS
        while len(got) < 2 and time.monotonic() < deadline:
            message = next_message(gateway)
            got[type(message)] = message
        assert got.get(Outputs) == chunk(n), f"round {n}: {got}"
        beat = got.get(Heartbeat)
        assert isinstance(beat, Heartbeat) and beat.ping_sent_at == float(n), f"round {n}"
