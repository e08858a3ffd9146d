"""The waiting queue's orders, weighted round-robin between tenants, and caps; pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count

import pytest

from loomserve.protocol import SamplingParams
from loomserve.worker.sched.queueing import Policy, WaitingQueue
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.sched.slots import Request

_ids = count()


@dataclass(eq=False)
class Item:
    """A stand-in request: what the queue reads of one."""

    name: str
    priority: int = 0
    tenant: str = "default"
    order: int = -1


def drain(queue: WaitingQueue, n: int | None = None) -> list[str]:
    """Pop up to n requests (all when None), as free slots would; their names in order."""
    names = []
    while queue and (n is None or len(names) < n):
        item = queue.pop()
        if item is None:
            break
        names.append(item.name)
    return names


def test_fcfs_is_arrival_order_whatever_the_priority():
    queue = WaitingQueue(Policy.FCFS)
    for name, priority in [("a", 5), ("b", 0), ("c", -3)]:
        queue.push(Item(name, priority))
    assert len(queue) == 3
    assert drain(queue) == ["a", "b", "c"]
    assert not queue and queue.pop() is None and queue.peek() is None


def test_priority_orders_by_priority_then_arrival():
    queue = WaitingQueue("priority")
    for name, priority in [("a", 1), ("b", 0), ("c", 1), ("d", -2), ("e", 0)]:
        queue.push(Item(name, priority))
    assert queue.peek().name == "d"
    assert drain(queue) == ["d", "b", "e", "a", "c"]


def test_a_requeued_request_keeps_its_place():
    queue = WaitingQueue("priority")
    first, second = Item("first", 1), Item("second", 1)
    queue.push(first)
    queue.push(second)
    assert queue.pop() is first
    queue.push(Item("later", 1))
    queue.push(first)  # preempted: back where it arrived, ahead of later ones
    assert drain(queue) == ["first", "second", "later"]


def test_remove_takes_a_request_out_wherever_it_is():
    queue = WaitingQueue()
    items = [Item(str(i), tenant="t" + str(i % 2)) for i in range(5)]
    for item in items:
        queue.push(item)
    queue.remove(items[2])
    assert len(queue) == 4
    with pytest.raises(ValueError):
        queue.remove(items[2])
    with pytest.raises(ValueError):
        queue.remove(Item("never", tenant="nobody"))
    assert sorted(drain(queue)) == ["0", "1", "3", "4"]


def test_tenants_take_turns():
    queue = WaitingQueue()
    for i in range(3):
        queue.push(Item(f"a{i}", tenant="a"))
    for i in range(3):
        queue.push(Item(f"b{i}", tenant="b"))
    assert drain(queue) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_weights_share_the_turns():
    queue = WaitingQueue(weights={"big": 3.0})
    for i in range(8):
        queue.push(Item(f"big{i}", tenant="big"))
        queue.push(Item(f"small{i}", tenant="small"))
    turns = drain(queue, 8)
    assert sum(name.startswith("big") for name in turns) == 6  # 3 : 1
    assert sum(name.startswith("small") for name in turns) == 2


def test_a_single_request_waits_at_most_one_turn_behind_a_backlog():
    queue = WaitingQueue()
    for i in range(40):
        queue.push(Item(f"bulk{i}", tenant="bulk"))
    assert drain(queue, 10) == [f"bulk{i}" for i in range(10)]  # alone, it takes every turn
    queue.push(Item("single", tenant="one"))
    assert drain(queue, 1) == ["single"]  # it arrived during the backlog: the next turn

    # Even when it arrives right after the backlog's tenant took a turn.
    queue.push(Item("again", tenant="one"))
    assert drain(queue, 2) in (["again", "bulk10"], ["bulk10", "again"])


def test_idle_time_earns_no_credit():
    queue = WaitingQueue()
    queue.push(Item("x0", tenant="x"))
    assert drain(queue) == ["x0"]  # x had a turn; y never waited
    for i in range(20):
        queue.push(Item(f"y{i}", tenant="y"))
    drain(queue, 10)
    for i in range(3):
        queue.push(Item(f"x{i + 1}", tenant="x"))
    # x does not get ten turns in a row for the ten it "missed": turns alternate.
    assert drain(queue, 4) == ["x1", "y10", "x2", "y11"]


def test_under_priority_the_round_robin_runs_within_the_best_priority():
    queue = WaitingQueue("priority")
    queue.push(Item("a-low", 1, tenant="a"))
    queue.push(Item("b-low", 1, tenant="b"))
    queue.push(Item("a-high1", 0, tenant="a"))
    queue.push(Item("a-high2", 0, tenant="a"))
    queue.push(Item("b-high", 0, tenant="b"))
    # b had fewer turns, so its low-priority request goes before a's.
    assert drain(queue) == ["a-high1", "b-high", "a-high2", "b-low", "a-low"]


def test_a_tenant_at_its_cap_waits_and_others_go_ahead():
    queue = WaitingQueue(max_running_per_tenant=2)
    for i in range(4):
        queue.push(Item(f"a{i}", tenant="a"))
    for _ in range(2):
        queue.started(queue.pop().tenant)
    assert queue.counts()["a"] == (2, 2)
    queue.push(Item("b0", tenant="b"))
    assert queue.pop().name == "b0"
    queue.started("b")
    assert queue.peek() is None and queue.pop() is None and len(queue) == 2  # a is capped
    queue.stopped("a")
    assert queue.pop().name == "a2"


def test_tenants_without_requests_are_forgotten():
    queue = WaitingQueue()
    item = Item("u", tenant="user-123")
    queue.push(item)
    queue.started(queue.pop().tenant)
    assert "user-123" in queue.counts()
    queue.stopped("user-123")
    assert queue.counts() == {}


# --- through the scheduler: tenants share its slots ---------------------------------------


def scheduled(tenant: str, name: str) -> Request:
    return Request((b"gw", name), [1, len(name)], SamplingParams(), 0.0, tenant=tenant)


def test_the_scheduler_admits_round_robin_and_holds_to_the_cap():
    queue = WaitingQueue(weights={"bulk": 2.0}, max_running_per_tenant=3)
    scheduler = Scheduler(n_slots=4, max_queue=64, slot_context=64, waiting=queue)
    for i in range(10):
        scheduler.enqueue(scheduled("bulk", f"bulk{i}"))
    scheduler.enqueue(scheduled("solo", "solo0"))
    admitted = [a.request.request_id for a in scheduler.admit(tick=0, now=0.0)]
    # bulk has twice solo's weight but may hold only 3 slots: the fourth goes to solo.
    assert sorted(admitted) == ["bulk0", "bulk1", "bulk2", "solo0"]
    assert scheduler.waiting.counts() == {"bulk": (3, 7), "solo": (1, 0)}

    scheduler.cancel((b"gw", "bulk0"))
    scheduler.release_finished(tick=1, now=0.0)
    assert [a.request.request_id for a in scheduler.admit(tick=1, now=0.0)] == ["bulk3"]
