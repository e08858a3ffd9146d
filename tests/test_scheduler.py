"""The scheduler's queue and slot bookkeeping; pure Python, no model."""

from __future__ import annotations

import pytest

from loomserve.protocol import FinishReason, SamplingParams
from loomserve.worker.scheduler import Request, Scheduler, common_prefix
from loomserve.worker.strategies import SlotPhase

GW = b"gateway-1"


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(key=(GW, request_id), prompt=prompt, params=SamplingParams(), arrived_at=0.0)


def finish_and_release(scheduler: Scheduler, request_id: str, generated=(), tick: int = 1):
    """Finish a running request as the loop would: generated tokens, the last one unevaluated."""
    slot = next(s for s in scheduler.slots if s.request and s.request.request_id == request_id)
    slot.tokens.extend(generated)
    slot.n_cached = len(slot.tokens) - 1 if generated else len(slot.tokens)
    slot.finish(FinishReason.STOP)
    return slot, scheduler.release(slot, tick, keep_cache=True)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([], [1], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2], 2),
        ([1, 2, 9, 4], [1, 2, 3, 4], 2),
    ],
)
def test_common_prefix(a, b, expected):
    assert common_prefix(a, b) == expected
    assert common_prefix(b, a) == expected


def test_long_common_prefix_is_exact():
    a = list(range(5000))
    for cut in (0, 1, 2499, 4999):
        b = [*a[:cut], -1, *a[cut + 1 :]]
        assert common_prefix(a, b) == cut


def test_queue_is_fifo_and_bounded_by_slots_plus_max_queue():
    scheduler = Scheduler(n_slots=2, max_queue=3, slot_context=64)
    waits = []
    for i in range(5):
        assert scheduler.can_enqueue()
        waits.append(scheduler.enqueue(request(f"r{i}", [1, i])))
    assert not scheduler.can_enqueue()
    assert waits == [0, 0, 1, 2, 3]  # requests ahead of each once the free slots are taken
    admitted = scheduler.admit(tick=0, now=1.0)
    assert [a.request.request_id for a in admitted] == ["r0", "r1"]
    assert scheduler.queue_depth == 3 and scheduler.free_slots == 0 and scheduler.running == 2
    assert not scheduler.can_enqueue()


def test_zero_max_queue_takes_only_what_a_free_slot_can_run():
    scheduler = Scheduler(n_slots=1, max_queue=0, slot_context=64)
    assert scheduler.can_enqueue()
    scheduler.enqueue(request("a", [1]))
    assert not scheduler.can_enqueue()


def test_admission_sets_the_slot_up_for_prefill():
    scheduler = Scheduler(n_slots=2, max_queue=4, slot_context=64)
    scheduler.enqueue(request("a", [1, 2, 3, 4]))
    (admission,) = scheduler.admit(tick=7, now=2.5)
    slot = admission.slot
    assert slot.phase is SlotPhase.PREFILLING and slot.prompt_remaining == 4
    assert slot.tokens == [1, 2, 3, 4] and slot.n_cached == 0 and admission.reused == 0
    assert slot.admitted_tick == 7 and admission.request.admitted_at == 2.5
    assert [view.index for view in scheduler.views()] == [slot.index]


def test_a_prompt_goes_to_the_slot_caching_its_longest_prefix():
    scheduler = Scheduler(n_slots=3, max_queue=4, slot_context=64)
    for name, prompt in [("a", [1, 2, 3, 4, 5]), ("b", [1, 2, 9, 9]), ("c", [7, 7])]:
        scheduler.enqueue(request(name, prompt))
    scheduler.admit(tick=0, now=0.0)
    slot_a, _ = finish_and_release(scheduler, "a", generated=[6, 7])
    finish_and_release(scheduler, "b", generated=[5])
    assert slot_a.tokens == [1, 2, 3, 4, 5, 6]  # the slot keeps exactly its cached tokens

    scheduler.enqueue(request("d", [1, 2, 3, 4, 8, 8]))
    (admission,) = scheduler.admit(tick=2, now=0.0)
    assert admission.slot is slot_a and admission.reused == 4
    assert admission.request.cached_tokens == 4 and admission.slot.n_cached == 4


@pytest.mark.parametrize(("min_copy_tokens", "copied"), [(1, True), (4, True), (5, False)])
def test_a_busy_slots_longer_prefix_is_copied_when_it_saves_enough(
    min_copy_tokens: int, copied: bool
):
    scheduler = Scheduler(n_slots=2, max_queue=4, slot_context=64, min_copy_tokens=min_copy_tokens)
    scheduler.enqueue(request("running", [1, 2, 3, 4, 5, 6]))
    (running,) = scheduler.admit(tick=0, now=0.0)
    running.slot.n_cached = 6  # its prompt is in the cache; it is generating now
    scheduler.enqueue(request("next", [1, 2, 3, 4, 9]))
    (admission,) = scheduler.admit(tick=1, now=0.0)
    assert admission.slot is not running.slot
    if copied:  # 4 shared tokens
        assert admission.source is running.slot and admission.reused == 4
    else:
        assert admission.source is None and admission.reused == 0


def test_the_last_prompt_token_is_always_evaluated_again():
    scheduler = Scheduler(n_slots=1, max_queue=4, slot_context=64)
    scheduler.enqueue(request("a", [1, 2, 3]))
    scheduler.admit(tick=0, now=0.0)
    finish_and_release(scheduler, "a")
    scheduler.enqueue(request("again", [1, 2, 3]))
    (admission,) = scheduler.admit(tick=1, now=0.0)
    assert admission.reused == 2  # its logits give the first new token
    assert admission.slot.prompt_remaining == 1


def test_without_a_shared_prefix_the_least_recently_used_slot_is_taken():
    scheduler = Scheduler(n_slots=2, max_queue=4, slot_context=64)
    scheduler.enqueue(request("a", [1, 2]))
    scheduler.enqueue(request("b", [3, 4]))
    scheduler.admit(tick=0, now=0.0)
    slot_b, _ = finish_and_release(scheduler, "b", tick=1)
    finish_and_release(scheduler, "a", tick=2)
    scheduler.enqueue(request("c", [9]))
    (admission,) = scheduler.admit(tick=3, now=0.0)
    assert admission.slot is slot_b  # a's cache, used last, stays for a while longer


def test_release_keeps_or_forgets_the_cache():
    scheduler = Scheduler(n_slots=1, max_queue=1, slot_context=64)
    scheduler.enqueue(request("a", [1, 2, 3]))
    (admission,) = scheduler.admit(tick=0, now=0.0)
    slot = admission.slot
    slot.n_cached = 3
    slot.tokens.append(42)  # sampled, never evaluated
    slot.finish(FinishReason.LENGTH)
    assert scheduler.finished_slots() == [slot]
    scheduler.release(slot, tick=1, keep_cache=True)
    assert slot.tokens == [1, 2, 3] and slot.phase is SlotPhase.IDLE and not slot.busy
    assert scheduler.live == {} and scheduler.free_slots == 1

    scheduler.enqueue(request("b", [5]))
    (admission,) = scheduler.admit(tick=2, now=0.0)
    admission.slot.finish(FinishReason.CANCELLED)
    scheduler.release(admission.slot, tick=3, keep_cache=False)
    assert admission.slot.tokens == [] and admission.slot.n_cached == 0


def test_cancel_removes_a_queued_request_and_marks_a_running_one():
    scheduler = Scheduler(n_slots=1, max_queue=2, slot_context=64)
    scheduler.enqueue(request("running", [1]))
    scheduler.enqueue(request("queued", [2]))
    scheduler.admit(tick=0, now=0.0)
    queued = scheduler.cancel((GW, "queued"))
    assert queued is not None and queued.request_id == "queued"
    assert scheduler.queue_depth == 0 and (GW, "queued") not in scheduler.live

    assert scheduler.cancel((GW, "running")) is None
    (slot,) = scheduler.finished_slots()
    assert slot.finish_reason is FinishReason.CANCELLED
    assert scheduler.views() == []  # a finished slot gets no more batch tokens

    assert scheduler.cancel((GW, "never-was")) is None
    assert scheduler.cancel((b"other-gateway", "running")) is None


def test_first_finish_reason_wins():
    scheduler = Scheduler(n_slots=1, max_queue=0, slot_context=64)
    scheduler.enqueue(request("a", [1]))
    (admission,) = scheduler.admit(tick=0, now=0.0)
    admission.slot.finish(FinishReason.LENGTH)
    admission.slot.finish(FinishReason.CANCELLED)
    assert admission.slot.finish_reason is FinishReason.LENGTH


def test_keys_of_a_gateway():
    scheduler = Scheduler(n_slots=1, max_queue=4, slot_context=64)
    scheduler.enqueue(request("a", [1]))
    scheduler.enqueue(Request((b"other", "a"), [1], SamplingParams(), 0.0))
    scheduler.enqueue(request("b", [1]))
    assert scheduler.keys_of(GW) == [(GW, "a"), (GW, "b")]
