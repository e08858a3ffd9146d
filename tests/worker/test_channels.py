"""What IO and the loop share (channels.py): the inbox's order and the published load; pure
Python, no model."""

from __future__ import annotations

from loomserve.protocol import Embed, Generate, SamplingParams
from loomserve.protocol.prefix_keys import prefix_keys
from loomserve.worker.channels import STOP, Cancel, GatewayGone, Inbox, LoadBoard, Submit
from loomserve.worker.scheduler import Scheduler
from loomserve.worker.slots import Request

GW = b"gw"


def test_the_inbox_keeps_the_order_of_every_kind_of_item() -> None:
    inbox = Inbox()
    assert inbox.get(block=False) is None and inbox.empty()
    generate = Generate("g", [1, 2], SamplingParams())
    embed = Embed("e", [[1, 2]])
    inbox.submit(GW, generate)
    inbox.submit(GW, embed)  # one kind of item for both: the loop tells them apart
    inbox.cancel(GW, "g")
    inbox.gateway_gone(GW, "it disconnected")
    inbox.stop()
    items = [inbox.get(block=False) for _ in range(5)]
    assert items == [
        Submit(GW, generate),
        Submit(GW, embed),
        Cancel(GW, "g"),
        GatewayGone(GW, "it disconnected"),
        STOP,
    ]
    assert inbox.get(block=False) is None


def test_the_load_board_publishes_the_scheduler_and_its_prefixes_at_most_once_per_interval():
    scheduler = Scheduler(n_slots=2, max_queue=4, slot_context=1024)
    board = LoadBoard(slots=2)
    assert (board.latest.free_slots, board.latest.running, board.latest.prefixes) == (2, 0, ())
    slot = scheduler.slots[0]
    slot.tokens, slot.n_in_cache = list(range(1, 129)), 128  # a cached sequence, two blocks
    scheduler.enqueue(Request((GW, "r"), [1, 2], SamplingParams(), arrived_at=0.0))
    board.publish(scheduler, prefixes_every=3600.0)
    first = board.latest
    assert (first.queue_depth, first.free_slots, first.running) == (1, 2, 0)
    assert set(first.prefixes) == set(prefix_keys(list(range(1, 129))))
    slot.tokens, slot.n_in_cache = [], 0  # the cache changed, but within the interval
    board.publish(scheduler, prefixes_every=3600.0)
    assert board.latest.prefixes == first.prefixes and board.latest is not first
    board.publish(scheduler, prefixes_every=0.0)
    assert board.latest.prefixes == ()
