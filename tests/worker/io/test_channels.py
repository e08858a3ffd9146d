"""What IO and the loop share (io/channels.py): the inbox's order and the published
SchedulerStats; pure Python, no model."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from loomserve.protocol import Embed, Generate, Load, SamplingParams
from loomserve.protocol.prefix_keys import prefix_keys
from loomserve.worker.cache.prefix_cache import AdvertisedPrefixes
from loomserve.worker.io.channels import STOP, Abort, GatewayGone, Inbox, StatsBoard, Submit
from loomserve.worker.sched.records import scheduler_stats
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.sched.slots import Request
from loomserve.worker.stats import TickCost

GW = b"gw"


def publish(board: StatsBoard, scheduler: Scheduler, prefixes: AdvertisedPrefixes) -> None:
    """What the loop does after each tick."""
    keys = prefixes.keys(scheduler.slots, scheduler.ram)
    board.publish(scheduler_stats(scheduler, TickCost(), keys))


def test_the_inbox_keeps_the_order_of_every_kind_of_item() -> None:
    inbox = Inbox()
    assert inbox.get(block=False) is None and inbox.empty()
    generate = Generate("g", [1, 2], SamplingParams())
    embed = Embed("e", [[1, 2]])
    inbox.submit(GW, generate)
    inbox.submit(GW, embed)  # one kind of item for both: the loop tells them apart
    inbox.abort(GW, "g")
    inbox.gateway_gone(GW, "it disconnected")
    inbox.stop()
    items = [inbox.get(block=False) for _ in range(5)]
    assert items == [
        Submit(GW, generate),
        Submit(GW, embed),
        Abort(GW, "g"),
        GatewayGone(GW, "it disconnected"),
        STOP,
    ]
    assert inbox.get(block=False) is None


def test_the_board_publishes_the_scheduler_and_its_prefixes_at_most_once_per_interval():
    scheduler = Scheduler(n_slots=2, max_queue=4, slot_context=1024)
    board, prefixes = StatsBoard(slots=2), AdvertisedPrefixes(every=3600.0)
    assert (board.latest.load, board.latest.prefixes) == (Load(0, 2, 0), ())
    slot = scheduler.slots[0]
    slot.tokens, slot.n_in_cache = list(range(1, 129)), 128  # a cached sequence, two blocks
    scheduler.enqueue(Request((GW, "r"), [1, 2], SamplingParams(), arrived_at=0.0))
    publish(board, scheduler, prefixes)
    first = board.latest
    assert first.load == Load(queue_depth=1, free_slots=2, running=0)
    assert set(first.prefixes) == set(prefix_keys(list(range(1, 129))))
    slot.tokens, slot.n_in_cache = [], 0  # the cache changed, but within the interval
    publish(board, scheduler, prefixes)
    assert board.latest.prefixes == first.prefixes and board.latest is not first
    prefixes.every = 0.0
    publish(board, scheduler, prefixes)
    assert board.latest.prefixes == ()


def test_the_slots_snapshot_is_a_copy_that_the_loop_moves_on_from() -> None:
    """Other threads read the published stats only: a later tick's changes to the live slots
    never show in a snapshot already published, and a slot's figures come out of its copy."""
    scheduler = Scheduler(n_slots=3, max_queue=4, slot_context=1024)
    board, prefixes = StatsBoard(slots=3), AdvertisedPrefixes(every=3600.0)
    assert [s.state for s in board.latest.slot_states(now=0.0)] == ["idle"] * 3
    request = Request(
        (GW, "r1"), [5, 6, 7, 8], SamplingParams(), arrived_at=10.0, priority=2, tenant="team"
    )
    scheduler.enqueue(request)
    scheduler.enqueue(Request((GW, "r2"), [5], SamplingParams(), arrived_at=10.5))
    (admission, second) = scheduler.admit(tick=1, now=11.0)
    slot = admission.slot
    slot.n_in_cache = 4  # the prompt evaluated
    scheduler.record_token(slot, 42, end_of_generation=False, now=12.0)
    publish(board, scheduler, prefixes)
    published = board.latest

    for token in range(9):  # the loop goes on: nine more tokens, one second apart
        scheduler.record_token(slot, token, end_of_generation=False, now=13.0 + token)
    assert request.completion_tokens == 10

    states = published.slot_states(now=14.0)
    busy = next(s for s in states if s.request_id == "r1")
    assert (busy.index, busy.state, busy.gateway, busy.tenant) == (
        slot.index,
        "generating",
        "gw",
        "team",
    )
    assert (busy.priority, busy.prompt_tokens, busy.generated_tokens) == (2, 4, 1)
    assert busy.cached_tokens + busy.computed_tokens == 4
    assert busy.age_seconds == 4.0 and busy.tokens_per_second == 0.0  # one token: no rate yet
    assert next(s for s in states if s.request_id == "r2").state == "prefilling"
    assert [s.state for s in states if not s.request_id] == ["idle"]
    assert [s.index for s in states] == [0, 1, 2]
    assert second.slot.index != slot.index

    publish(board, scheduler, prefixes)
    now = board.latest.slot_states(now=22.0)
    busy = next(s for s in now if s.request_id == "r1")
    # Nine tokens after the first, over the ten seconds since it came.
    assert busy.generated_tokens == 10 and busy.tokens_per_second == 0.9
    assert [(t.tenant, t.running, t.waiting) for t in board.latest.tenant_queues()] == [
        ("default", 1, 0),
        ("team", 1, 0),
    ]


# The worker's SIGTERM handler calls Inbox.stop() on the main thread, which may be inside
# Inbox.get() at that moment (the loop reads its inbox between ticks, where the watchdog does
# not look). A signal every millisecond for 3 s, each putting a STOP, while the main thread
# does nothing but read.
STOP_FROM_A_SIGNAL = textwrap.dedent(
    """
    import signal, time
    from loomserve.worker.io.channels import Inbox

    inbox, signals = Inbox(), []
    def on_signal(*_):
        signals.append(1)
        inbox.stop()
    signal.signal(signal.SIGALRM, on_signal)
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        inbox.get(block=False)
    signal.setitimer(signal.ITIMER_REAL, 0)
    print("read on through", len(signals), "signals")
    """
)


def test_a_stop_from_a_signal_handler_never_deadlocks_the_thread_it_interrupts() -> None:
    """With a queue.Queue inside, the handler's put() waited for the lock its own thread held
    in get(): one SIGTERM hung a scaled-in worker for good (CI), and this script died of
    nested handlers within a second. A SimpleQueue's put() is reentrant."""
    result = subprocess.run(
        [sys.executable, "-c", STOP_FROM_A_SIGNAL], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-1500:]
    assert "read on through" in result.stdout
