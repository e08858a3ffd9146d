"""The RAM prompt cache on the real llama.cpp and the tiny model: multi-turn conversations
with more conversations than slots, in-process and in a worker process. No mocks."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import llama_cpp as llama
import pytest
import zmq

from loomserve.protocol import Finish, Generate, Hello, ModelInfo, Outputs, SamplingParams
from loomserve.protocol.codec import decode, encode
from loomserve.protocol.prefix_keys import PREFIX_KEY_BLOCK
from loomserve.worker.cache.prefix_cache import usable_prefix
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.metrics import WorkerMetrics
from loomserve.worker.tick.loop import TickLoop
from tests.procs import free_port, scrape_metrics, start_worker

GW = b"gw-1"
SLOTS = 2


class Collector:
    """A Sink that keeps each request's tokens and finish."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finishes: dict[str, Finish] = {}

    def send(self, gateway: bytes, message) -> None:
        if isinstance(message, Outputs):
            for chunk in message.tokens:
                self.tokens.setdefault(chunk.request_id, []).extend(chunk.token_ids)
            for finish in message.finishes:
                assert finish.request_id not in self.finishes, "a request finished twice"
                self.finishes[finish.request_id] = finish

    def flush(self) -> None:
        pass


@pytest.fixture
def config(tiny_model_path: Path) -> WorkerConfig:
    return WorkerConfig(
        model_path=tiny_model_path,
        slots=SLOTS,
        ctx_size=512,
        batch_tokens=64,
        prefill_chunk=16,
        threads=1,
        cache_ram=64,
    )


@pytest.fixture
def engine(config: WorkerConfig) -> Iterator[Engine]:
    engine = Engine(config)
    yield engine
    engine.close()


def greedy(request_id: str, prompt: list[int], max_tokens: int) -> Generate:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Generate(request_id, prompt, params)


def run(loop: TickLoop, collector: Collector, generate: Generate) -> list[int]:
    loop.inbox.submit(GW, generate)
    for _ in range(5000):
        loop.tick(block=False)
        if generate.request_id in collector.finishes:
            return collector.tokens.get(generate.request_id, [])
    raise AssertionError(f"{generate.request_id} did not finish")


def converse(
    loop: TickLoop, n_conversations: int, n_turns: int, seed: int = 3
) -> tuple[dict[str, list[int]], Collector]:
    """Chat clients taking turns: each turn sends the whole history plus a new message.

    The conversations go round-robin, one request at a time, so with more conversations than
    slots each turn finds its history's slot taken by others.
    """
    collector: Collector = loop.sink  # type: ignore[assignment]
    rng = random.Random(seed)
    histories = [[1, *(rng.randrange(3, 200) for _ in range(48))] for _ in range(n_conversations)]
    outputs = {}
    for turn in range(n_turns):
        for c, history in enumerate(histories):
            history += [rng.randrange(3, 200) for _ in range(rng.randrange(4, 12))]
            request_id = f"c{c}t{turn}"
            reply = run(loop, collector, greedy(request_id, list(history), 10))
            outputs[request_id] = reply
            history += reply
    return outputs, collector


def new_loop(engine: Engine, config: WorkerConfig, **changes) -> TickLoop:
    return TickLoop(engine, replace(config, **changes), Collector())


def assert_no_leaked_cells(loop: TickLoop) -> None:
    for slot in loop.scheduler.slots:
        assert not slot.busy
        assert loop.engine.seq_pos_max(slot.index) == slot.n_in_cache - 1
        assert llama.llama_memory_seq_pos_min(loop.engine.memory, slot.index) in (0, -1)


def test_conversations_beyond_the_slots_restore_their_history_from_ram(engine, config):
    n_conversations, n_turns = 5, 3
    with_cache = new_loop(engine, config)
    cached, collector = converse(with_cache, n_conversations, n_turns)
    stats = with_cache.scheduler.ram.stats
    # Every later turn found its history in RAM: its slot served other conversations since.
    assert stats.hits >= n_conversations * (n_turns - 1) - SLOTS
    later = [f for rid, f in collector.finishes.items() if not rid.endswith("t0")]
    assert all(f.cached_tokens >= 48 for f in later)
    assert stats.restored_tokens >= 48 * stats.hits
    assert_no_leaked_cells(with_cache)

    without = new_loop(engine, config, cache_ram=0)
    uncached, plain = converse(without, n_conversations, n_turns)
    # Greedy output does not depend on where the prefix came from.
    assert cached == uncached
    assert without.scheduler.ram.stats.hits == 0 and len(without.scheduler.ram) == 0
    assert sum(f.cached_tokens for f in plain.finishes.values()) < sum(
        f.cached_tokens for f in collector.finishes.values()
    )


def test_the_ram_cache_never_holds_more_than_its_budget(engine, config):
    one_state = None
    loop = new_loop(engine, config)
    run(loop, loop.sink, greedy("probe", [1, *range(10, 70)], 4))
    one_state = engine.state_size(loop.scheduler.slots[0].index) or engine.state_size(1)
    assert one_state > 0
    # Room for about two conversations' states: the least recently used are evicted.
    budget = int(2.5 * one_state)
    small = new_loop(engine, config, cache_ram=1)
    small.scheduler.ram.capacity = budget
    converse(small, 6, 2)
    ram = small.scheduler.ram
    assert 0 < ram.used <= budget
    assert ram.stats.evictions > 0
    assert ram.used == sum(entry.n_bytes for entry in ram)
    assert_no_leaked_cells(small)


def test_the_metrics_report_hits_tokens_and_bytes(engine, config):
    loop = new_loop(engine, config)
    metrics = WorkerMetrics()
    metrics.watch(
        loop.board,
        model_name="tiny",
        architecture=engine.description.architecture,
        slots=config.slots,
        slot_context=engine.slot_context,
    )
    converse(loop, 4, 2)
    sample = metrics.registry.get_sample_value
    ram = loop.scheduler.ram
    assert sample("loomserve:ram_cache_hits_total") == ram.stats.hits > 0
    assert sample("loomserve:ram_cache_restored_tokens_total") == ram.stats.restored_tokens
    assert sample("loomserve:ram_cache_used_bytes") == ram.used > 0
    assert sample("loomserve:ram_cache_capacity_bytes") == 64 * 1024**2
    assert sample("loomserve:ram_cache_entries") == len(ram)


def test_heartbeats_advertise_the_ram_cached_prompts(engine, config):
    loop = new_loop(engine, config, heartbeat_interval=0.0)  # a fresh view every tick
    converse(loop, 4, 2)
    ram = loop.scheduler.ram
    long_enough = [entry for entry in ram if len(entry.tokens) >= PREFIX_KEY_BLOCK]
    assert len(long_enough) >= 2  # four conversations on two slots
    advertised = set(loop.stats.prefixes)
    for entry in long_enough:
        assert entry.keys and set(entry.keys) <= advertised


# --- a worker process -----------------------------------------------------------------------


def test_a_worker_process_serves_later_turns_from_its_ram_cache(tiny_model_path: Path):
    metrics_port = free_port()
    with start_worker(
        tiny_model_path, slots=1, ctx_size=512, cache_ram=32, metrics_port=metrics_port
    ) as worker:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"gw-ram")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(worker.endpoint)
        try:
            sock.send_multipart(encode(Hello("gw-ram")))
            assert isinstance(receive(sock, lambda m: isinstance(m, ModelInfo)), ModelInfo)
            a, b = [1, *range(20, 140)], [1, *range(150, 250)]
            first_a = generate(sock, greedy("a1", a, 6))
            generate(sock, greedy("b1", b, 6))  # takes the one slot: a's cells go to RAM
            turn = [*a, *first_a[0], 7, 8]
            again = generate(sock, greedy("a2", turn, 6))
            # a and 5 of its tokens were cached (the 6th was never evaluated); the last 64
            # tokens run again, as the whole prompt's last pass had 64 rows or more.
            assert usable_prefix(len(a) + 5, len(turn), 512) == len(turn) - 64
            assert again[1].cached_tokens == len(turn) - 64
        finally:
            sock.close(linger=0)
        samples = scrape_metrics(f"http://127.0.0.1:{metrics_port}/metrics")
        assert samples[("loomserve:ram_cache_hits_total", ())] >= 1
        assert samples[("loomserve:ram_cache_used_bytes", ())] > 0


def receive(sock: zmq.Socket, predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            message = decode(sock.recv_multipart())
            if predicate(message):
                return message
    raise AssertionError("no matching message")


def generate(sock: zmq.Socket, request: Generate) -> tuple[list[int], Finish]:
    sock.send_multipart(encode(request))
    tokens: list[int] = []
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        message = receive(sock, lambda m: isinstance(m, Outputs))
        for chunk in message.tokens:
            if chunk.request_id == request.request_id:
                tokens += chunk.token_ids
        for finish in message.finishes:
            if finish.request_id == request.request_id:
                return tokens, finish
    raise AssertionError(f"{request.request_id} did not finish")
