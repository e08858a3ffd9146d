"""The worker's socket against peers that are not well-behaved gateways: strangers without the
CURVE key, floods of huge, junk and nested frames, and a second worker on the same ipc path.
Real worker processes on the tiny model; raw ZeroMQ sockets."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
from click.testing import CliRunner

from loomserve.cli.health import probe
from loomserve.cli.keygen import ensure_certificates
from loomserve.cli.main import main
from loomserve.protocol import (
    PROTOCOL_VERSION,
    Accepted,
    Cancel,
    Generate,
    Heartbeat,
    Hello,
    ImageTokens,
    ImageTokensQuery,
    Load,
    ModelInfo,
    Outputs,
    Ping,
    Rejected,
    SamplingParams,
    SlotsQuery,
    SlotsReport,
    VocabFile,
    WorkerError,
    decode,
    encode,
)
from loomserve.protocol.messages import ErrorCode
from loomserve.worker.config import WorkerConfig, is_local_endpoint
from loomserve.worker.io.channels import Abort, GatewayGone, Inbox, Submit
from loomserve.worker.io.gateways import GatewayDesk, GatewayTable, Replies
from tests.procs import Proc, start_worker, wait_worker_ready

MIB = 1024 * 1024


def dealer(
    endpoint: str, identity: str, curve: tuple[Path, Path] | None = None, hwm: int = 1000
) -> zmq.Socket:
    """A raw DEALER, a CURVE client when curve = (worker.key, own .key_secret)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.SNDHWM, hwm)
    if curve is not None:
        from loomserve.gateway.workers.curve import set_curve_client

        set_curve_client(sock, *curve)
    sock.connect(endpoint)
    return sock


def answer(sock: zmq.Socket, message, timeout: float, kind: type) -> object | None:
    """Send message, then the first reply of type kind within timeout (None if none)."""
    try:
        # A socket whose handshake was refused has no peer to queue for: sending would block.
        sock.send_multipart(encode(message), zmq.NOBLOCK)
    except zmq.Again:
        return None
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            return None
        reply = decode(sock.recv_multipart())
        if isinstance(reply, kind):
            return reply
    return None


def anonymous_rss_mib(pid: int) -> float:
    """The process's resident anonymous memory: its heaps and mmapped blocks, where a flood
    would be kept. Not VmRSS, whose file-backed part (library code, the model's pages) comes
    and goes with the page cache (a CI run once saw VmRSS grow 44 MiB here; no rerun did)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    ensure_certificates(tmp_path / "keys", ["worker", "gateway", "stranger"])
    return tmp_path / "keys"


# --- CURVE -----------------------------------------------------------------------------------


def test_curve_lets_in_the_allowed_key_only_and_logs_the_others(tiny_model_path, keys):
    worker = start_worker(
        tiny_model_path,
        wait=False,
        curve_secret_key_file=keys / "worker.key_secret",
        curve_allowed_keys=keys / "gateway.key",
    )
    with worker:
        allowed = dealer(
            worker.endpoint, "gw-allowed", (keys / "worker.key", keys / "gateway.key_secret")
        )
        deadline = time.monotonic() + 60
        info = None
        while info is None and time.monotonic() < deadline and worker.alive():
            info = answer(allowed, Hello("gw-allowed"), 0.5, ModelInfo)
        assert isinstance(info, ModelInfo) and info.ready
        found = probe(worker.endpoint, 5.0, (keys / "worker.key", keys / "gateway.key_secret"))
        assert isinstance(found.beat, Heartbeat)

        stranger = dealer(
            worker.endpoint, "gw-stranger", (keys / "worker.key", keys / "stranger.key_secret")
        )
        plain = dealer(worker.endpoint, "gw-plain")
        for sock in (stranger, plain):
            assert answer(sock, Hello("intruder"), 1.5, ModelInfo) is None
            assert answer(sock, Ping(1.0), 0.5, Heartbeat) is None
        assert probe(worker.endpoint, 1.0).beat is None
        # The allowed gateway is served on, undisturbed.
        assert isinstance(answer(allowed, Ping(2.0), 5.0, Heartbeat), Heartbeat)
        stranger_key = (keys / "stranger.key").read_text().split('public-key = "')[1][:40]
        logs = worker.logs()
        assert "not in the allow-list" in logs and stranger_key in logs
        for sock in (allowed, stranger, plain):
            sock.close()


def test_a_network_bind_needs_curve_or_insecure_bind(tiny_model_path, keys):
    assert is_local_endpoint("ipc:///tmp/w.ipc") and is_local_endpoint("tcp://127.0.0.1:5555")
    assert is_local_endpoint("tcp://[::1]:5555") and is_local_endpoint("tcp://localhost:5555")
    for endpoint in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://eth0:5555", "tcp://10.0.0.2:1"):
        assert not is_local_endpoint(endpoint), endpoint
        with pytest.raises(ValueError, match="--insecure-bind"):
            WorkerConfig(tiny_model_path, bind=endpoint)
        WorkerConfig(tiny_model_path, bind=endpoint, insecure_bind=True)
        WorkerConfig(
            tiny_model_path,
            bind=endpoint,
            curve_secret_key_file=keys / "worker.key_secret",
            curve_allowed_keys=keys,
        )
    with pytest.raises(ValueError, match="together"):
        WorkerConfig(tiny_model_path, curve_secret_key_file=keys / "worker.key_secret")
    result = CliRunner().invoke(
        main, ["worker", "--model", str(tiny_model_path), "--bind", "tcp://0.0.0.0:5555"]
    )
    assert result.exit_code == 2 and "--insecure-bind" in result.output


def test_keygen_keeps_existing_certificates(tmp_path: Path):
    first = CliRunner().invoke(main, ["keygen", str(tmp_path / "k")])
    assert first.exit_code == 0 and first.output.count("made") == 2
    secret = (tmp_path / "k" / "worker.key_secret").read_text()
    assert (tmp_path / "k" / "worker.key_secret").stat().st_mode & 0o077 == 0
    again = CliRunner().invoke(main, ["keygen", str(tmp_path / "k")])
    assert again.output.count("kept") == 2
    assert (tmp_path / "k" / "worker.key_secret").read_text() == secret


# --- floods ---------------------------------------------------------------------------------


class Pinger(threading.Thread):
    """A gateway that pings every 100 ms and records each round trip, until stopped."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.rtts: list[float] = []
        self.missed = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        sock = dealer(self.endpoint, "gw-pinger")
        assert answer(sock, Hello("gw-pinger"), 10, ModelInfo)
        while not self.stopping.is_set():
            sent = time.monotonic()
            if answer(sock, Ping(time.time()), 1.0, Heartbeat) is None:
                self.missed += 1
            else:
                self.rtts.append(time.monotonic() - sent)
            time.sleep(0.1)
        sock.close()


@pytest.fixture
def flooded_worker(tiny_model_path) -> Iterator[tuple[Proc, Pinger]]:
    with start_worker(tiny_model_path, slots=2, max_queue=4) as worker:
        pinger = Pinger(worker.endpoint)
        pinger.start()
        time.sleep(0.5)
        yield worker, pinger
        pinger.stopping.set()
        pinger.join(5)


@pytest.mark.slow
def test_floods_are_dropped_cheaply_and_liveness_holds(flooded_worker):
    worker, pinger = flooded_worker
    flood = dealer(worker.endpoint, "flooder", hwm=100_000)
    assert answer(flood, Hello("flooder"), 10, ModelInfo)
    rss_before = anonymous_rss_mib(worker.pid)

    # Forty valid 12 MB Generates, each a prompt of 12 million token ids: refused at the
    # array's header, by request id, without building the list.
    huge = encode(Generate("huge", [1] * (12 * MIB), SamplingParams()))
    for _ in range(40):
        flood.send_multipart(huge)
    rejected = [answer_any(flood, 10.0) for _ in range(40)]
    assert all(isinstance(r, Rejected) and r.code == ErrorCode.PROMPT_TOO_LONG for r in rejected)

    # 100k junk frames, and nested arrays where token ids belong (16 MiB of them).
    for i in range(100_000):
        flood.send_multipart([b"\x02", b"\xc1" if i % 2 else os.urandom(8)], copy=False)
    bomb = b"\x93" + msgpack.packb("b") + b"\xdd" + (200_000).to_bytes(4, "big")
    bomb += (b"\xdc\x00\x50" + b"\x90" * 80) * 200_000 + msgpack.packb([])
    for _ in range(4):
        flood.send_multipart([b"\x02", bomb])
    # A reply to a Ping behind them says all were read (the flooder, silent through its
    # junk, may have been given up on meanwhile: then the reply is a GATEWAY_LOST error).
    flood.send_multipart(encode(Ping(3.0)))
    assert answer_any(flood, 30.0) is not None

    # A frame over 16 MiB drops its connection; the worker serves on.
    oversize = zmq.Context.instance().socket(zmq.DEALER)
    oversize.setsockopt(zmq.LINGER, 0)
    oversize.setsockopt(zmq.RECONNECT_IVL, -1)  # dropped, it stays dropped
    oversize.connect(worker.endpoint)
    assert answer(oversize, Ping(4.0), 5.0, Heartbeat)
    oversize.send_multipart([b"\x02", b"\x00" * (17 * MIB)])
    time.sleep(0.5)
    assert answer(oversize, Ping(5.0), 1.0, Heartbeat) is None

    growth = anonymous_rss_mib(worker.pid) - rss_before
    print(f"anonymous RSS growth {growth:.1f} MiB; ping p100 {max(pinger.rtts) * 1000:.0f} ms")
    assert growth < 24, f"the floods grew the worker's RSS by {growth:.0f} MiB"
    assert pinger.missed == 0 and max(pinger.rtts) < 1.0, pinger.rtts
    # And real work still runs.
    good = dealer(worker.endpoint, "gw-after")
    assert answer(good, Hello("gw-after"), 5, ModelInfo)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    good.send_multipart(encode(Generate("ok", [1, 5, 6], params)))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        reply = answer_any(good, 5.0)
        if isinstance(reply, Outputs) and reply.finishes:
            assert reply.finishes[0].reason == "length"
            break
    else:
        raise AssertionError("the request after the floods did not finish")
    for sock in (flood, oversize, good):
        sock.close()


def answer_any(sock: zmq.Socket, timeout: float) -> object | None:
    """The next message other than a heartbeat within timeout."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            return None
        reply = decode(sock.recv_multipart())
        if not isinstance(reply, Heartbeat):
            return reply
    return None


def test_one_gateway_cannot_queue_more_than_the_worker_holds(flooded_worker):
    worker, _ = flooded_worker
    sock = dealer(worker.endpoint, "greedy-gw")
    assert answer(sock, Hello("greedy-gw"), 10, ModelInfo)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(500):
        sock.send_multipart(encode(Generate(f"g{i}", [1, 7], params)))
    answered, open_now, most_open, refused = 0, 0, 0, []
    while answered < 500:
        reply = answer_any(sock, 10.0)
        assert reply is not None, f"{answered} of 500 answered"
        if isinstance(reply, Accepted):
            answered, open_now = answered + 1, open_now + 1
            most_open = max(most_open, open_now)
        elif isinstance(reply, Rejected):
            answered += 1
            refused.append(reply)
        elif isinstance(reply, Outputs):
            open_now -= len(reply.finishes)
    # Two slots and a queue of four: never more open, the rest refused at the socket.
    assert most_open == 6 and len(refused) >= 400, (most_open, len(refused))
    assert {r.code for r in refused} == {"queue_full"}
    assert any("this gateway has 6 requests open" in r.message for r in refused)
    sock.close()


# --- ipc -------------------------------------------------------------------------------------


def test_a_second_worker_on_a_live_ipc_path_exits_at_once(tiny_model_path, tmp_path):
    endpoint = f"ipc://{tmp_path / 'worker.ipc'}"
    args = ["worker", "--model", str(tiny_model_path), "--bind", endpoint, "--slots", "1",
            "--ctx-size", "128", "--threads", "1", "--no-log-json"]  # fmt: skip
    with Proc("worker", args) as first:
        first.endpoint = endpoint
        wait_worker_ready(first)
        second = Proc("worker-2", args)
        started = time.monotonic()
        try:
            code = second.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            second.kill()
            raise AssertionError("the second worker did not exit") from None
        assert code == 1 and time.monotonic() - started < 20
        assert "another worker" in second.logs() and f"pid {first.pid}" in second.logs()
        assert "model loaded" not in second.logs()  # it failed before loading anything
        wait_worker_ready(first, timeout=5)  # the first still owns its socket
    # Once the first is gone, the path is free again.
    with Proc("worker-3", args) as third:
        third.endpoint = endpoint
        wait_worker_ready(third)


# --- the gateway table ----------------------------------------------------------------------


def test_the_gateway_table_bounds_gateways_open_requests_and_cancels():
    table = GatewayTable(max_gateways=2, max_open=3, lost_remembered=2)
    for gateway in (b"a", b"b"):
        assert table.can_admit(gateway)
        table.admit(gateway, 0.0)
    assert not table.can_admit(b"c") and table.can_admit(b"a")
    assert [table.open(b"a", f"r{i}") for i in range(3)] == [None] * 3
    assert table.open(b"a", "r3")[0] == ErrorCode.QUEUE_FULL
    assert table.open(b"b", "r0") is None  # the cap is per gateway
    # A duplicate id goes on to the loop (which rejects it in order), up to the same cap.
    assert table.open(b"a", "r0") is None
    table.close(b"a", "r0", duplicate=True)
    assert table.cancel(b"a", "r1") and not table.cancel(b"a", "r1")  # once
    assert not table.cancel(b"a", "unknown") and not table.cancel(b"zz", "r1")
    table.close(b"a", "r1")
    assert table.open(b"a", "r4") is None and not table.cancel(b"a", "r1")
    assert table.silent(10.0, 5.0) == [b"a", b"b"]
    table.admit(b"a", 9.0)
    assert table.silent(10.0, 5.0) == [b"b"]
    for gateway in (b"a", b"b"):
        assert table.lose(gateway)
    assert not table.lose(b"a") and len(table) == 0
    for i in range(5):
        table.admit(bytes([i]), 0.0)
        table.lose(bytes([i]))
    assert len(table.lost) == 2  # a flood of identities cannot grow it


# --- the desk: what each gateway message gets, without a socket -----------------------------


class Said:
    """The desk's Replies, kept: what it sent to whom."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []
        self.replies = Replies(
            send=lambda gateway, message: self.sent.append((gateway, message)),
            hello=lambda: ModelInfo(PROTOCOL_VERSION, "m", 32, 64, 64, 2, "fp", ready=True),
            heartbeat=lambda sent_at: Heartbeat(1.0, sent_at, True, Load(0, 2, 0)),
            slots_report=lambda query_id: SlotsReport(query_id, 0, [], []),
            vocab=lambda fingerprint: VocabFile(fingerprint, b"", "none here"),
        )

    def take(self) -> list[tuple[bytes, object]]:
        sent, self.sent = self.sent, []
        return sent


def inbox_items(inbox: Inbox) -> list[object]:
    items = []
    while (item := inbox.get(block=False)) is not None:
        items.append(item)
    return items


def test_the_desk_answers_what_it_can_and_hands_work_to_the_loop():
    said, inbox, joined = Said(), Inbox(), []
    desk = GatewayDesk(inbox, said.replies, max_items=64, max_open=1, on_gateways=joined.append)
    # A probe that never said Hello gets a heartbeat, and is no gateway.
    assert not desk.handle(b"probe", Ping(5.0), now=0.0)
    [(to, beat)] = said.take()
    assert to == b"probe" and isinstance(beat, Heartbeat) and beat.ping_sent_at == 5.0
    assert b"probe" not in desk.table and joined == []
    # Hello: the model, and the gateway is known.
    assert not desk.handle(b"gw", Hello("g1"), now=1.0)
    assert [type(m) for _, m in said.take()] == [ModelInfo] and joined == [1]
    # A Generate is work for the loop; the second one open is refused at the door.
    params = SamplingParams(max_tokens=1)
    assert desk.handle(b"gw", Generate("a", [1, 2], params), now=2.0)
    assert desk.handle(b"gw", Generate("b", [1, 2], params), now=2.0)
    [(to, rejected)] = said.take()
    assert isinstance(rejected, Rejected) and rejected.request_id == "b"
    assert rejected.code == ErrorCode.QUEUE_FULL.value
    # A Cancel reaches the loop once; queries are answered on the spot.
    assert not desk.handle(b"gw", Cancel("a"), now=3.0)
    assert not desk.handle(b"gw", Cancel("a"), now=3.0)
    assert not desk.handle(b"gw", SlotsQuery("q"), now=3.0)
    assert [type(m) for _, m in said.take()] == [SlotsReport]
    submit, abort = inbox_items(inbox)
    assert isinstance(submit, Submit) and submit.message.request_id == "a"
    assert isinstance(abort, Abort) and abort.request_id == "a"


def test_the_desk_hands_image_counts_to_the_encoder_or_says_it_has_none():
    said, inbox, counted = Said(), Inbox(), []
    with_projector = GatewayDesk(
        inbox,
        said.replies,
        max_items=64,
        max_open=4,
        count_images=lambda gateway, query: counted.append((gateway, query)),
    )
    query = ImageTokensQuery("q", [b"\x89PNG"])
    with_projector.handle(b"gw", Hello("g1"), now=0.0)
    said.take()
    assert not with_projector.handle(b"gw", query, now=1.0)
    assert counted == [(b"gw", query)] and said.take() == [] and inbox_items(inbox) == []
    without = GatewayDesk(inbox, said.replies, max_items=64, max_open=4)
    without.handle(b"gw", Hello("g1"), now=0.0)
    said.take()
    assert not without.handle(b"gw", query, now=1.0)
    [(to, answer)] = said.take()
    assert to == b"gw" and answer == ImageTokens("q", [], answer.error)
    assert "no --mmproj" in answer.error


def test_the_desk_gives_up_on_silent_gateways_and_refuses_their_work_until_hello():
    said, inbox = Said(), Inbox()
    desk = GatewayDesk(inbox, said.replies, max_items=64, max_open=4)
    desk.handle(b"gw", Hello("g1"), now=0.0)
    desk.handle(b"gw", Generate("a", [1], SamplingParams(max_tokens=1)), now=0.0)
    said.take()
    inbox_items(inbox)
    desk.expire_silent(now=10.0, timeout=5.0)
    [gone] = inbox_items(inbox)
    assert isinstance(gone, GatewayGone) and "silent for 5s" in gone.why
    assert desk.counters.gateways_lost == 1
    assert not desk.handle(b"gw", Generate("b", [1], SamplingParams(max_tokens=1)), now=11.0)
    [(_, error)] = said.take()
    assert isinstance(error, WorkerError) and error.code == ErrorCode.GATEWAY_LOST.value
    assert inbox_items(inbox) == []
    desk.handle(b"gw", Hello("g1"), now=12.0)  # forgiven
    assert b"gw" in desk.table and b"gw" not in desk.table.lost


def test_the_desk_rejects_an_undecodable_generate_it_can_name_and_counts_it():
    said, inbox = Said(), Inbox()
    desk = GatewayDesk(inbox, said.replies, max_items=4, max_open=4)
    desk.handle(b"gw", Hello("g1"), now=0.0)
    said.take()
    frames = encode(Generate("long", list(range(10)), SamplingParams(max_tokens=1)))
    assert not desk.receive(b"gw", frames, now=1.0)
    [(_, rejected)] = said.take()
    assert isinstance(rejected, Rejected) and rejected.request_id == "long"
    assert rejected.code == ErrorCode.PROMPT_TOO_LONG.value
    assert desk.receive(b"gw", [b"\xff", b"junk"], now=1.0) is False
    assert desk.counters.malformed == 2 and inbox_items(inbox) == []
