"""The scheduler's queue and each request's life in a slot; pure Python, no model.

The tests drive the scheduler through its own API, as the tick loop does, with made-up tokens
standing in for what the engine would sample: no copy of the loop and no engine.
"""

from __future__ import annotations

import pytest

from loomserve.protocol import FinishReason, SamplingParams, TokenChunk
from loomserve.worker.cache.ram_cache import common_prefix
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.sched.slots import Request, Slot
from loomserve.worker.sched.strategies import BatchPlan, SlotPhase

GW = b"gateway-1"
EOS = -1  # the test's end-of-generation token


def request(request_id: str, prompt: list[int], **params) -> Request:
    return Request(
        key=(GW, request_id), prompt=prompt, params=SamplingParams(**params), arrived_at=0.0
    )


def slot_of(scheduler: Scheduler, request_id: str) -> Slot:
    return next(s for s in scheduler.slots if s.request and s.request.request_id == request_id)


def forward(scheduler: Scheduler, tokens: dict[str, int] | None = None, stop=(), budget=64):
    """One tick after admission, as the loop runs it without an engine: plan, advance, and
    record a made-up sampled token for each slot that samples (`tokens[request id]`, else
    100 + the slot's index; an end-of-generation token for the ids in `stop`)."""
    step = scheduler.schedule(budget, chunk_size=budget)
    scheduler.advance(step)
    chunks = []
    for run in step.runs:
        if run.sample:
            request_id = run.slot.request.request_id
            token = (tokens or {}).get(request_id, 100 + run.slot.index)
            chunks.append(scheduler.record_token(run.slot, token, request_id in stop, now=5.0))
    return step, chunks


def finish_and_release(scheduler: Scheduler, request_id: str, generated=(), tick: int = 1):
    """Run a request to its end: its prompt, then the `generated` tokens, the last of which
    ends it (an end-of-generation token, sampled but never evaluated); then release it."""
    slot = slot_of(scheduler, request_id)
    tokens = list(generated) or [EOS]
    for i, token in enumerate(tokens):
        forward(scheduler, {request_id: token}, stop={request_id} if i == len(tokens) - 1 else ())
    assert slot.finish_reason is FinishReason.STOP
    releases = scheduler.release_finished(tick, now=9.0)
    (release,) = [r for r in releases if r.request.request_id == request_id]
    return slot, release


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
    assert slot.tokens == [1, 2, 3, 4] and slot.n_in_cache == 0 and admission.reused == 0
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
    assert admission.request.cached_tokens == 4 and admission.slot.n_in_cache == 4


@pytest.mark.parametrize(("min_copy_tokens", "copied"), [(1, True), (4, True), (5, False)])
def test_a_busy_slots_longer_prefix_is_copied_when_it_saves_enough(
    min_copy_tokens: int, copied: bool
):
    scheduler = Scheduler(n_slots=2, max_queue=4, slot_context=64, min_copy_tokens=min_copy_tokens)
    scheduler.enqueue(request("running", [1, 2, 3, 4, 5, 6]))
    (running,) = scheduler.admit(tick=0, now=0.0)
    forward(scheduler)  # its prompt is in the cache; it is generating now
    assert running.slot.n_in_cache == 6 and running.slot.phase is SlotPhase.GENERATING
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
    scheduler.enqueue(request("a", [1, 2, 3], max_tokens=1))
    (admission,) = scheduler.admit(tick=0, now=0.0)
    slot = admission.slot
    _, chunks = forward(scheduler, {"a": 42})  # sampled, never evaluated
    assert chunks == [TokenChunk("a", [42])] and slot.finish_reason is FinishReason.LENGTH
    (release,) = scheduler.release_finished(tick=1, now=0.0)
    assert release.request is admission.request and release.drop_sequence is None
    assert slot.tokens == [1, 2, 3] and slot.phase is SlotPhase.IDLE and not slot.busy
    assert scheduler.live == {} and scheduler.free_slots == 1

    scheduler.enqueue(request("b", [5]))
    (admission,) = scheduler.admit(tick=2, now=0.0)
    scheduler.cancel((GW, "b"))
    (release,) = scheduler.release_finished(tick=3, now=0.0)
    assert release.drop_sequence == admission.slot.index  # the engine drops its cells
    assert admission.slot.tokens == [] and admission.slot.n_in_cache == 0


def test_cancel_removes_a_queued_request_and_marks_a_running_one():
    scheduler = Scheduler(n_slots=1, max_queue=2, slot_context=64)
    scheduler.enqueue(request("running", [1]))
    scheduler.enqueue(request("queued", [2]))
    scheduler.admit(tick=0, now=0.0)
    assert scheduler.cancel((GW, "queued"))
    assert scheduler.queue_depth == 0 and (GW, "queued") not in scheduler.live

    assert scheduler.cancel((GW, "running"))
    assert slot_of(scheduler, "running").finish_reason is FinishReason.CANCELLED
    assert scheduler.views() == []  # a finished slot gets no more batch tokens
    assert scheduler.schedule(64, 64).n_tokens == 0 and scheduler.has_work()

    assert not scheduler.cancel((GW, "never-was"))
    assert not scheduler.cancel((b"other-gateway", "running"))
    queued, running = scheduler.release_finished(tick=1, now=3.0)
    assert queued.request.request_id == "queued" and queued.finish.reason == "cancelled"
    assert queued.drop_sequence is None  # it never had a slot
    assert queued.finish.queue_seconds == 3.0  # never admitted: it waited until its end
    assert running.request.request_id == "running" and running.finish.reason == "cancelled"
    assert running.drop_sequence == 0
    assert not scheduler.has_work() and scheduler.live == {}


def test_first_finish_reason_wins():
    scheduler = Scheduler(n_slots=1, max_queue=0, slot_context=64)
    scheduler.enqueue(request("a", [1], max_tokens=1))
    scheduler.admit(tick=0, now=0.0)
    forward(scheduler)  # its one token ends it
    scheduler.cancel((GW, "a"))  # too late: it already ended
    (release,) = scheduler.release_finished(tick=1, now=0.0)
    assert release.finish.reason == FinishReason.LENGTH and release.drop_sequence is None


def test_keys_of_a_gateway():
    scheduler = Scheduler(n_slots=1, max_queue=4, slot_context=64)
    scheduler.enqueue(request("a", [1]))
    scheduler.enqueue(Request((b"other", "a"), [1], SamplingParams(), 0.0))
    scheduler.enqueue(request("b", [1]))
    assert scheduler.keys_of(GW) == [(GW, "a"), (GW, "b")]


# --- the cycle: plan, advance, record, finish ------------------------------------------------


def test_a_prompt_scored_for_its_logprobs_is_evaluated_whole_with_logits_on_all():
    scheduler = Scheduler(n_slots=2, max_queue=4, slot_context=64)
    scheduler.enqueue(request("a", [1, 2, 3, 4, 5]))
    scheduler.admit(tick=0, now=0.0)
    slot_a, _ = finish_and_release(scheduler, "a", tick=1)
    scheduler.enqueue(request("b", [7]))
    scheduler.admit(tick=2, now=0.0)
    finish_and_release(scheduler, "b", tick=3)  # slot a's cache is the older one now
    scheduler.enqueue(request("scored", [1, 2, 3, 4, 5, 6], prompt_logprobs=2))
    (admission,) = scheduler.admit(tick=4, now=0.0)
    # Its cached prefix would have no logits: none reused, and the other cache is kept.
    assert admission.reused == 0 and admission.source is None
    assert admission.slot is slot_a and admission.request.cached_tokens == 0
    step = scheduler.schedule(budget=64, chunk_size=4)
    assert [(r.tokens, r.start, r.sample, r.score) for r in step.runs] == [
        ([1, 2, 3, 4], 0, False, True)
    ]
    scheduler.advance(step)
    step = scheduler.schedule(budget=64, chunk_size=4)
    assert [(r.tokens, r.sample, r.score) for r in step.runs] == [([5, 6], True, True)]
    scheduler.advance(step)
    scheduler.record_token(slot_a, 9, False, now=1.0)
    (decode,) = scheduler.schedule(budget=64, chunk_size=4).runs
    assert (decode.tokens, decode.score) == ([9], False)  # generating: logits only to sample


def test_a_prompt_is_prefilled_in_chunks_then_decoded():
    scheduler = Scheduler(n_slots=2, max_queue=0, slot_context=64)
    scheduler.enqueue(request("long", list(range(1, 11))))
    scheduler.admit(tick=0, now=0.0)
    slot = slot_of(scheduler, "long")
    step = scheduler.schedule(budget=64, chunk_size=4)
    (run,) = step.runs
    assert (run.slot, run.tokens, run.start, run.sample) == (slot, [1, 2, 3, 4], 0, False)
    scheduler.advance(step)
    assert slot.n_in_cache == 4 and slot.prompt_remaining == 6

    scheduler.enqueue(request("short", [7, 8]))
    scheduler.admit(tick=1, now=0.0)
    step = scheduler.schedule(budget=64, chunk_size=4)
    assert [(r.tokens, r.start, r.sample) for r in step.runs] == [
        ([5, 6, 7, 8], 4, False),
        ([7, 8], 0, True),  # its last prompt token: logits to sample from
    ]
    scheduler.advance(step)
    chunk = scheduler.record_token(step.runs[1].slot, 50, False, now=1.0)
    assert chunk == TokenChunk("short", [50])

    # Runs go in slot order: the generating slot's last token, at its next position, after
    # the first slot's last prompt chunk.
    step = scheduler.schedule(budget=64, chunk_size=4)
    prefill, decode = step.runs
    assert (prefill.slot, decode.slot) == (slot, slot_of(scheduler, "short"))
    assert (decode.tokens, decode.start, decode.sample) == ([50], 2, True)
    assert (prefill.tokens, prefill.start, prefill.sample) == ([9, 10], 8, True)
    assert step.plan == BatchPlan(decode=[decode.slot.index], prefill={slot.index: 2})
    scheduler.advance(step)
    assert decode.slot.n_in_cache == 3 and slot.n_in_cache == 10
    scheduler.record_token(slot, 60, False, now=2.0)
    assert slot.phase is SlotPhase.GENERATING and slot.tokens[-1] == 60
    assert slot.request.first_token_at == 2.0 and slot.request.completion_tokens == 1


def test_an_end_of_generation_token_stops_and_is_not_sent_unless_eos_is_ignored():
    scheduler = Scheduler(n_slots=2, max_queue=0, slot_context=64)
    scheduler.enqueue(request("eos", [1, 2]))
    scheduler.enqueue(request("ignored", [1, 2], ignore_eos=True))
    scheduler.admit(tick=0, now=0.0)
    _, chunks = forward(scheduler, {"eos": EOS, "ignored": EOS}, stop={"eos", "ignored"})
    assert chunks == [None, TokenChunk("ignored", [EOS])]
    assert slot_of(scheduler, "ignored").finish_reason is None
    (release,) = scheduler.release_finished(tick=1, now=0.0)
    assert release.finish.reason == FinishReason.STOP
    assert release.finish.completion_tokens == 1  # counted, though never sent


def test_max_tokens_and_the_slot_context_end_a_request_after_its_token():
    scheduler = Scheduler(n_slots=2, max_queue=0, slot_context=6)
    scheduler.enqueue(request("short", [1, 2], max_tokens=2))
    scheduler.enqueue(request("long", [1, 2, 3], max_tokens=100))
    scheduler.admit(tick=0, now=0.0)
    sent: dict[str, list[int]] = {}
    ends = {}
    for tick in range(1, 10):
        if not scheduler.has_work():
            break
        for chunk in forward(scheduler)[1]:
            sent.setdefault(chunk.request_id, []).extend(chunk.token_ids)
        for release in scheduler.release_finished(tick, now=0.0):
            ends[release.request.request_id] = release.finish
    assert ends["short"].reason == FinishReason.LENGTH and len(sent["short"]) == 2
    # The slot holds 6 tokens: 3 of prompt, 3 generated, the last one sent too.
    assert ends["long"].reason == FinishReason.LENGTH and len(sent["long"]) == 3
    assert ends["long"].prompt_tokens + ends["long"].completion_tokens == 6


def test_a_failed_forward_pass_fails_its_requests_and_drops_their_cells():
    scheduler = Scheduler(n_slots=3, max_queue=0, slot_context=64)
    for name in ("a", "b"):
        scheduler.enqueue(request(name, [1, 2]))
    scheduler.admit(tick=0, now=0.0)
    step = scheduler.schedule(64, 64)
    scheduler.fail(step, "llama_decode failed with code -1")
    releases = scheduler.release_finished(tick=1, now=0.0)
    assert [r.finish.reason for r in releases] == [FinishReason.ERROR] * 2
    assert {r.finish.message for r in releases} == {"llama_decode failed with code -1"}
    assert sorted(r.drop_sequence for r in releases) == [0, 1]
    assert all(slot.n_in_cache == 0 and not slot.busy for slot in scheduler.slots)


def test_fail_running_ends_every_running_request_but_not_the_queue():
    scheduler = Scheduler(n_slots=1, max_queue=1, slot_context=64)
    scheduler.enqueue(request("running", [1]))
    scheduler.enqueue(request("queued", [2]))
    scheduler.admit(tick=0, now=0.0)
    scheduler.fail_running("internal error")
    (release,) = scheduler.release_finished(tick=1, now=0.0)
    assert release.request.request_id == "running" and release.finish.reason == "error"
    assert scheduler.queue_depth == 1


def test_a_lost_prefix_is_evaluated_again_and_not_counted_as_a_hit():
    scheduler = Scheduler(n_slots=1, max_queue=1, slot_context=64)
    scheduler.enqueue(request("a", [1, 2, 3]))
    scheduler.admit(tick=0, now=0.0)
    finish_and_release(scheduler, "a")
    scheduler.enqueue(request("b", [1, 2, 3, 4]))
    (admission,) = scheduler.admit(tick=2, now=0.0)
    assert admission.reused == 3
    scheduler.prefix_lost(admission)  # the engine could not cut the sequence there
    assert admission.slot.prompt_remaining == 4
    (run,) = scheduler.schedule(64, 64).runs
    assert (run.tokens, run.start) == ([1, 2, 3, 4], 0)
    _, release = finish_and_release(scheduler, "b", tick=3)
    assert release.finish.cached_tokens == 0


def test_the_finish_tells_the_requests_counts_and_wait():
    scheduler = Scheduler(n_slots=1, max_queue=1, slot_context=64)
    scheduler.enqueue(request("a", [1, 2, 3]))
    scheduler.admit(tick=0, now=0.0)
    finish_and_release(scheduler, "a")
    late = request("b", [1, 2, 3, 4, 5])
    late.arrived_at = 1.0
    scheduler.enqueue(late)
    scheduler.admit(tick=2, now=1.25)
    _, release = finish_and_release(scheduler, "b", generated=[7, 8, 9], tick=3)
    finish = release.finish
    assert (finish.request_id, finish.reason, finish.message) == ("b", "stop", "")
    assert (finish.prompt_tokens, finish.completion_tokens, finish.cached_tokens) == (5, 3, 3)
    assert finish.queue_seconds == 0.25


class Raises:
    """A broken user strategy."""

    def plan(self, slots, budget, chunk_size, queue_depth):
        raise RuntimeError("bug")


def test_a_failing_strategy_falls_back_to_decode_maximal():
    scheduler = Scheduler(n_slots=2, max_queue=0, slot_context=64, strategy=Raises())
    scheduler.enqueue(request("a", [1, 2, 3, 4, 5]))
    scheduler.admit(tick=0, now=0.0)
    step = scheduler.schedule(budget=4, chunk_size=3)
    assert step.plan == BatchPlan(prefill={0: 3})
