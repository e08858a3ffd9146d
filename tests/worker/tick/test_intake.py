"""Whether the loop takes a request (intake.py): each refusal, in the order the checks run;
pure Python, no model."""

from __future__ import annotations

from loomserve.protocol import ErrorCode, Generate, SamplingParams
from loomserve.worker.sched.queueing import DEFAULT_TENANT
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.tick.intake import new_request, refusal

GW = b"gw"
N_VOCAB, CONTEXT = 100, 16


def generate(request_id: str, prompt: list[int], **fields) -> Generate:
    return Generate(request_id, prompt, SamplingParams(max_tokens=4), **fields)


def check(scheduler: Scheduler, message: Generate, stopping: bool = False):
    key = (GW, message.request_id)
    found = refusal(key, message, scheduler, N_VOCAB, CONTEXT, stopping)
    return None if found is None else found[0]


def test_each_refusal_and_the_request_taken() -> None:
    scheduler = Scheduler(n_slots=1, max_queue=1, slot_context=CONTEXT)
    assert check(scheduler, generate("a", [1, 2])) is None
    assert check(scheduler, generate("a", [1, 2]), stopping=True) is ErrorCode.NOT_READY
    assert check(scheduler, generate("v", [1, N_VOCAB])) is ErrorCode.INVALID_REQUEST
    assert check(scheduler, generate("l", [1] * (CONTEXT - 1))) is None
    assert check(scheduler, generate("l", [1] * CONTEXT)) is ErrorCode.PROMPT_TOO_LONG
    for request_id in ("a", "b"):  # one slot, one place in the queue
        message = generate(request_id, [1, 2], priority=3, tenant="t")
        scheduler.enqueue(new_request((GW, request_id), message, sampler=None))
    assert check(scheduler, generate("a", [1, 2])) is ErrorCode.DUPLICATE_REQUEST
    assert check(scheduler, generate("c", [1, 2])) is ErrorCode.QUEUE_FULL
    # The cheaper checks come first: a duplicate is a duplicate even when the queue is full.
    assert check(scheduler, generate("a", [1, 2]), stopping=True) is ErrorCode.NOT_READY
    taken = scheduler.live[(GW, "b")]
    assert (taken.prompt, taken.priority, taken.tenant) == ([1, 2], 3, "t")


def test_a_request_with_an_empty_tenant_has_the_default_one() -> None:
    request = new_request((GW, "x"), generate("x", [1], tenant=""), sampler=None)
    assert request.tenant == DEFAULT_TENANT and request.request_id == "x"
