"""Preemption under the priority policy: the scheduler's decisions (pure), then on the tiny
model, swapped out and recomputed, against uninterrupted runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loomserve.protocol import FinishReason, Generate, Outputs, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.engine.engine import Engine
from loomserve.worker.sched.preemption import choose_victim
from loomserve.worker.sched.queueing import WaitingQueue
from loomserve.worker.sched.scheduler import Scheduler
from loomserve.worker.sched.slots import Request, Slot
from loomserve.worker.sched.strategies import SlotPhase
from tests.worker.engine.test_engine import GW, drain, new_loop

# --- the scheduler's decisions, without a model -------------------------------------------


def request(request_id: str, prompt: list[int], priority: int = 0, **params) -> Request:
    params.setdefault("max_tokens", 100)
    return Request(
        key=(GW, request_id),
        prompt=prompt,
        params=SamplingParams(**params),
        arrived_at=0.0,
        priority=priority,
    )


def scheduler(n_slots: int = 2, policy: str = "priority", swap_bytes: int = 0) -> Scheduler:
    return Scheduler(
        n_slots, max_queue=4, slot_context=64, waiting=WaitingQueue(policy), swap_bytes=swap_bytes
    )


def generate(s: Scheduler, n_ticks: int) -> None:
    """Run n ticks without an engine: every sampling slot gets token 100 + its index."""
    for _ in range(n_ticks):
        step = s.schedule(64, 64)
        s.advance(step)
        for run in step.runs:
            if run.sample:
                s.record_token(run.slot, 100 + run.slot.index, False, now=1.0)


def slot_of(s: Scheduler, request_id: str) -> Slot:
    return next(x for x in s.slots if x.request and x.request.request_id == request_id)


def test_the_victim_is_the_worst_priority_and_the_latest_among_equals():
    low_early, low_late, high = request("a", [1], 2), request("b", [1], 2), request("c", [1], 0)
    for order, r in enumerate((low_early, low_late, high)):
        r.order = order
    assert choose_victim([low_early, high, low_late], request("new", [1], 1)) is low_late
    assert choose_victim([low_early, low_late], request("new", [1], 2)) is None  # equals
    assert choose_victim([], request("new", [1], 0)) is None


def test_fcfs_never_preempts():
    s = scheduler(n_slots=1, policy="fcfs")
    s.enqueue(request("low", [1, 2], priority=5))
    s.admit(tick=0, now=0.0)
    s.enqueue(request("urgent", [3], priority=-5))
    assert s.admit(tick=1, now=0.0) == []
    assert s.queue_depth == 1 and s.preemptions == 0


def test_a_better_priority_takes_the_slot_and_the_victim_resumes_by_recompute():
    s = scheduler(n_slots=2)
    s.enqueue(request("a", [1, 2, 3], priority=1))
    s.enqueue(request("b", [4, 5, 6], priority=1))
    s.admit(tick=0, now=0.0)
    generate(s, 3)  # each has 3 tokens: the last one sampled, not yet in the cache
    b_slot = slot_of(s, "b")
    assert b_slot.tokens == [4, 5, 6, 101, 101, 101] and b_slot.n_in_cache == 5

    s.enqueue(request("same", [7], priority=1))
    assert s.admit(tick=1, now=0.0) == []  # equal priority waits
    s.enqueue(request("urgent", [8, 9], priority=0))
    (admission,) = s.admit(tick=2, now=0.0)
    assert admission.request.request_id == "urgent" and admission.slot is b_slot
    preempted = admission.preempted
    assert preempted.request.request_id == "b" and preempted.n_cached == 5
    victim = preempted.request
    assert victim.resume_tokens == [4, 5, 6, 101, 101, 101] and victim.preemptions == 1
    assert s.preemptions == 1 and s.queue_depth == 2 and (GW, "b") in s.live
    assert s.waiting.peek() is victim  # it arrived before "same"

    # "urgent" finishes; b takes the free slot back and prefills its whole sequence: the
    # urgent request's cells replaced its own.
    slot_of(s, "urgent").finish(FinishReason.STOP)
    s.release_finished(tick=3, now=0.0)
    (resumed,) = s.admit(tick=3, now=0.0)
    slot = resumed.slot
    assert resumed.request is victim and resumed.restore is None
    assert slot.tokens == [4, 5, 6, 101, 101, 101] and slot.phase is SlotPhase.PREFILLING
    assert slot.prompt_remaining == 6 and resumed.reused == 0
    step = s.schedule(64, 64)
    (run,) = [r for r in step.runs if r.slot is slot]
    assert run.tokens == [4, 5, 6, 101, 101, 101] and run.sample  # the next token from it
    s.advance(step)
    s.record_token(slot, 7, False, now=2.0)
    assert victim.completion_tokens == 4 and slot.tokens[-2:] == [101, 7]


def test_a_swapped_out_request_resumes_from_its_saved_cells():
    s = scheduler(n_slots=1, swap_bytes=1000)
    s.enqueue(request("low", [1, 2, 3], priority=1))
    s.admit(tick=0, now=0.0)
    generate(s, 2)
    s.enqueue(request("high", [5], priority=0))
    (admission,) = s.admit(tick=1, now=0.0)
    preemption = admission.preempted
    assert s.swap.fits(600)
    s.swap_out(preemption, "saved cells", 600)
    assert s.swap.used == 600 and not s.swap.fits(600)

    slot_of(s, "high").finish(FinishReason.LENGTH)
    s.release_finished(tick=2, now=0.0)
    (resumed,) = s.admit(tick=2, now=0.0)
    assert resumed.restore == "saved cells" and resumed.reused == 4 and resumed.source is None
    assert resumed.slot.phase is SlotPhase.GENERATING and resumed.slot.n_in_cache == 4
    assert s.swap.used == 0 and resumed.request.saved_state is None
    (run,) = s.schedule(64, 64).runs
    assert run.tokens == [100] and run.start == 4  # it decodes on where it stopped


def test_cancelling_a_swapped_out_request_gives_its_swap_space_back():
    s = scheduler(n_slots=1, swap_bytes=1000)
    s.enqueue(request("low", [1, 2], priority=1))
    s.admit(tick=0, now=0.0)
    generate(s, 1)
    s.enqueue(request("high", [3], priority=0))
    (admission,) = s.admit(tick=1, now=0.0)
    s.swap_out(admission.preempted, b"x", 300)
    assert s.cancel((GW, "low"))
    assert s.swap.used == 0
    (release,) = s.release_finished(tick=2, now=0.0)
    assert release.finish.reason == "cancelled" and release.finish.completion_tokens == 1


def test_preemption_keeps_the_queue_bound():
    s = Scheduler(1, max_queue=1, slot_context=64, waiting=WaitingQueue("priority"))
    s.enqueue(request("low", [1], priority=1))
    s.admit(tick=0, now=0.0)
    s.enqueue(request("high", [2], priority=0))
    assert not s.can_enqueue()
    s.admit(tick=1, now=0.0)  # high runs, low waits: still one running, one waiting
    assert s.running == 1 and s.queue_depth == 1 and not s.can_enqueue()


# --- on the tiny model: the output is what it would have been -----------------------------


def preemption_config(tiny_model_path, **changes) -> WorkerConfig:
    """Two slots under the priority policy: two urgent requests preempt both."""
    return WorkerConfig(
        model_path=tiny_model_path,
        slots=2,
        ctx_size=256,
        batch_tokens=32,
        prefill_chunk=7,
        threads=1,
        scheduling_policy="priority",
        **changes,
    )


@pytest.fixture
def config(tiny_model_path) -> WorkerConfig:
    return preemption_config(tiny_model_path)


@pytest.fixture
def engine(config: WorkerConfig):
    engine = Engine(config)
    yield engine
    engine.close()


def low(i: int, **params) -> Generate:
    params.setdefault("temperature", 0.0)
    prompt = [1, *range(10 + 7 * i, 40 + 7 * i)]
    return Generate(f"low{i}", prompt, SamplingParams(max_tokens=30, ignore_eos=True, **params), 1)


def urgent(i: int) -> Generate:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return Generate(f"urgent{i}", [1, 200 + i, 201 + i, 202 + i], params, 0)


def run(engine, config, requests: list[Generate], urgent_after: int | None) -> dict:
    """Run the requests; with urgent_after, two urgent ones arrive after that many ticks."""
    loop, collector = new_loop(engine, config)
    for generate_ in requests:
        loop.inbox.submit(GW, generate_)
    if urgent_after is not None:
        for _ in range(urgent_after):
            loop.tick(block=False)
        loop.inbox.submit(GW, urgent(0))
        loop.inbox.submit(GW, urgent(1))
    drain(loop)
    finishes = collector.finishes()
    assert all(f.reason == "length" for f in finishes.values())
    return collector.tokens(), loop


@pytest.mark.parametrize("swap_space", [1.0, 0.0], ids=["swap", "recompute"])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_preempted_requests_resume_with_the_same_greedy_output(
    engine, config, swap_space, batch_invariant
):
    if not batch_invariant:
        engine.close()
        config = replace(config, batch_invariant=False)
        engine = Engine(config)
    config = replace(config, swap_space=swap_space)
    expected, _ = run(engine, config, [low(0), low(1)], urgent_after=None)
    got, loop = run(engine, config, [low(0), low(1)], urgent_after=12)
    assert loop.scheduler.preemptions == 2
    assert loop.scheduler.swap.used == 0
    assert got["low0"] == expected["low0"] and got["low1"] == expected["low1"]
    assert len(got["low0"]) == 30  # no token repeated or lost
    assert got["urgent0"] == run(engine, config, [urgent(0)], None)[0]["urgent0"]
    if not batch_invariant:
        engine.close()


def logprobs_of(loop, request_id: str) -> list:
    return [
        entry
        for _, message in loop.sink.messages
        if isinstance(message, Outputs)
        for chunk in message.tokens
        if chunk.request_id == request_id
        for entry in chunk.logprobs or []
    ]


def test_a_sampled_request_keeps_its_sampler_state_across_preemption(engine, config):
    seeded = [
        low(0, temperature=0.9, seed=7, repeat_penalty=1.3, logprobs=2),
        low(1, temperature=0.9, seed=8),
    ]
    expected, alone = run(engine, config, seeded, urgent_after=None)
    got, loop = run(engine, config, seeded, urgent_after=15)
    assert loop.scheduler.preemptions == 2
    assert got["low0"] == expected["low0"] and got["low1"] == expected["low1"]
    # The penalties' history, as logprobs report it, is the tokens generated, resumed or not.
    assert logprobs_of(loop, "low0") == logprobs_of(alone, "low0")
    assert len(logprobs_of(loop, "low0")) == 30
