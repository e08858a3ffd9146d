"""N-gram drafting, acceptance, the draft-length choice and the scheduler's draft bookkeeping;
pure Python, no model."""

from __future__ import annotations

import random

import pytest

from loomserve.protocol import FinishReason, SamplingParams
from loomserve.worker.config import WorkerConfig
from loomserve.worker.sched.scheduler import PendingOutputs, Scheduler
from loomserve.worker.sched.slots import Request, Sampled
from loomserve.worker.sched.speculation import (
    EXPLORE_INTERVAL,
    Acceptance,
    DraftCost,
    NgramIndex,
    Proposal,
    SpecSettings,
    Speculator,
    expected_accepted,
    plan_length,
)
from loomserve.worker.sched.strategies import SlotPhase
from loomserve.worker.sched.ubatches import SplitRules


def reference_proposal(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The latest earlier occurrence of the last n tokens, largest n first, by brute force."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        tail = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == tail:
                draft: list[int] = []
                for j in range(k):  # past the end, the draft copies itself (LZ77-style)
                    draft.append(tokens[end + j] if end + j < length else draft[end + j - length])
                return draft
    return []


# --- settings ---------------------------------------------------------------------------


def test_drafting_defaults_on_exactly_where_batch_invariance_is_off(tmp_path):
    model = tmp_path / "m.gguf"
    assert not WorkerConfig(model_path=model).speculates  # batch invariant by default
    assert WorkerConfig(model_path=model, batch_invariant=False).speculates
    for invariant in (True, False):
        for chosen in (True, False):
            config = WorkerConfig(model_path=model, batch_invariant=invariant, spec_ngram=chosen)
            assert config.speculates is chosen


# --- n-gram lookup ---------------------------------------------------------------------------


def test_the_latest_earlier_occurrence_is_proposed():
    index = NgramIndex(2, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2]
    # [1, 2] last occurred ending at 6 (followed by 3, 7, 1, 2); the current one is not a match.
    assert index.propose(tokens, 3) == [3, 7, 1]
    # Past the sequence's end the match's period (3, 7, 1, 2) repeats.
    assert index.propose(tokens, 10) == [3, 7, 1, 2, 3, 7, 1, 2, 3, 7]


def test_a_loop_of_period_one_drafts_its_token_k_times():
    index = NgramIndex(2, 3)
    assert index.propose([4, 8, 8, 8], 5) == [8, 8, 8, 8, 8]


def test_a_longer_match_wins_over_a_more_recent_shorter_one():
    index = NgramIndex(1, 3)
    tokens = [5, 6, 7, 40, 41, 9, 7, 50, 6, 7]
    # [6, 7] occurred at 1..2 (then 40); [7] alone occurred later at 6 (then 50).
    assert index.propose(tokens, 2) == [40, 41]


def test_no_match_proposes_nothing():
    index = NgramIndex(2, 4)
    assert index.propose([1, 2, 3, 4, 5], 8) == []
    assert index.propose([1], 8) == []
    assert index.propose([], 8) == []


def test_the_index_grows_with_its_sequence_and_agrees_with_brute_force():
    rng = random.Random(5)
    for trial in range(20):
        n_min, n_max, k = rng.randint(1, 3), 0, rng.randint(1, 8)
        n_max = n_min + rng.randint(0, 3)
        index = NgramIndex(n_min, n_max)
        tokens = [rng.randrange(6) for _ in range(rng.randrange(0, 30))]
        for _ in range(60):
            assert index.propose(tokens, k) == reference_proposal(tokens, n_min, n_max, k), trial
            tokens.extend(rng.randrange(6) for _ in range(rng.randint(1, 4)))


# --- acceptance and the expected gain ----------------------------------------------------


def test_acceptance_follows_the_recent_verifications():
    acceptance = Acceptance()
    fresh = acceptance.rate
    for _ in range(10):
        acceptance.update(drafted=8, accepted=0)
    assert acceptance.rate < 0.1 < fresh
    for _ in range(10):
        acceptance.update(drafted=8, accepted=8)
    assert acceptance.rate > 0.9
    acceptance.update(drafted=0, accepted=0)  # nothing drafted: nothing learned
    assert acceptance.rate > 0.9


def test_a_rejection_counts_once_and_what_follows_it_not_at_all():
    a, b = Acceptance(0.0, 0.0), Acceptance(0.0, 0.0)
    a.update(drafted=3, accepted=1)
    b.update(drafted=16, accepted=1)
    assert a.rate == b.rate == 0.5


def test_expected_accepted_is_the_sum_of_the_positions_chances():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4.0
    assert expected_accepted(0.0, 4) == 0.0
    assert expected_accepted(0.9, 0) == 0.0


# --- the tick's draft length -------------------------------------------------------------


def linear(base: float, per_token: float, fixed: float = 0.0):
    return lambda extra: base + (fixed + per_token * extra if extra else 0.0)


def test_cheap_drafts_are_taken_to_their_full_length():
    proposals = [Proposal(0, [1] * 8, rate=0.9)]
    assert plan_length(proposals, room=100, tick_seconds=linear(0.010, 0.0002)) == 8


def test_a_compute_bound_tick_drafts_nothing():
    # Sixteen slots, every extra token costs as much as a decode token does.
    proposals = [Proposal(i, [1] * 8, rate=0.6) for i in range(16)]
    assert plan_length(proposals, room=400, tick_seconds=linear(0.016, 0.001)) == 0


def test_low_acceptance_drafts_less():
    cost = linear(0.010, 0.001)
    sure = plan_length([Proposal(0, [1] * 16, rate=0.95)], 100, cost)
    unsure = plan_length([Proposal(0, [1] * 16, rate=0.5)], 100, cost)
    assert sure > unsure >= 1
    assert plan_length([Proposal(0, [1] * 16, rate=0.05)], 100, cost) == 0


def test_a_fixed_surcharge_needs_enough_accepted_tokens_to_pay_for_it():
    # A first extra token that costs two decodes: only a long, likely draft pays.
    cost = linear(0.010, 0.0001, fixed=0.020)
    assert plan_length([Proposal(0, [1] * 2, rate=0.9)], 100, cost) == 0
    assert plan_length([Proposal(0, [1] * 16, rate=0.95)], 100, cost) == 16


def test_uniform_drafts_pay_for_every_runs_filler_and_fit_the_room():
    proposals = [Proposal(0, [1] * 8, 0.9), Proposal(1, [], 0.9), Proposal(2, [], 0.9)]
    cost = linear(0.010, 0.0002)
    # Three growing runs: a length L costs 3·L extra tokens.
    assert plan_length(proposals, room=12, tick_seconds=cost, uniform=3) == 4
    assert plan_length(proposals, room=12, tick_seconds=cost, uniform=0) == 8


def test_lengths_that_add_a_forward_pass_are_left_out():
    proposals = [Proposal(0, [1] * 8, 0.9)]
    length = plan_length(proposals, 100, linear(0.010, 0.0001), allowed=lambda n: n <= 3)
    assert length == 3


def test_no_proposal_or_no_room_drafts_nothing():
    cost = linear(0.010, 0.0)
    assert plan_length([Proposal(0, [], 0.9)], 100, cost) == 0
    assert plan_length([Proposal(0, [1, 2], 0.9)], 0, cost) == 0


def test_the_draft_surcharge_is_learned():
    cost = DraftCost()
    rng = random.Random(1)
    for _ in range(200):
        extra = rng.randint(1, 32)
        cost.observe(extra, (0.012 + 0.0005 * extra) * rng.uniform(0.97, 1.03))
    assert cost.predict(0) == 0.0
    assert cost.predict(10) == pytest.approx(0.012 + 0.005, rel=0.1)
    assert cost.predict(30) == pytest.approx(0.012 + 0.015, rel=0.1)


def test_the_speculator_explores_after_passing_over_proposals():
    speculator = Speculator(SpecSettings(max_tokens=8), n_slots=1)
    proposals = [Proposal(0, [1] * 8, 0.9)]
    expensive = linear(0.010, 0.01)
    lengths = [
        speculator.choose(proposals, 100, expensive, 0, lambda n: True)
        for _ in range(EXPLORE_INTERVAL)
    ]
    assert lengths[:-1] == [0] * (EXPLORE_INTERVAL - 1)
    assert lengths[-1] > 0  # one tick measures the drafts' cost again


def test_each_request_has_its_own_index_and_acceptance():
    speculator = Speculator(SpecSettings(max_tokens=4, ngram_min=1, ngram_max=2), n_slots=2)
    first, second = object(), object()
    assert speculator.propose(0, first, [1, 2, 3, 1]).tokens == [2, 3, 1, 2]
    speculator.verified(0, first, drafted=4, accepted=0)
    assert speculator.propose(0, first, [1, 2, 3, 1]).rate < 0.8
    # A new request in the slot starts afresh: its own tokens, the prior acceptance.
    fresh = speculator.propose(0, second, [7, 8, 9])
    assert fresh.tokens == [] and fresh.rate == pytest.approx(0.8)


# --- the scheduler's bookkeeping -------------------------------------------------------------


def generating_scheduler(n_slots: int, per_slot_streams: bool) -> Scheduler:
    scheduler = Scheduler(
        n_slots, 8, 256, split_rules=SplitRules(per_slot_streams=per_slot_streams)
    )
    for i in range(n_slots):
        params = SamplingParams(max_tokens=64, temperature=0.0)
        scheduler.enqueue(Request((b"g", f"r{i}"), [1, 2, 3, 4], params, arrived_at=0.0))
    scheduler.admit(0, 0.0)
    step = scheduler.schedule(64, 64)
    scheduler.advance(step)
    for slot in scheduler.slots:
        scheduler.record_token(slot, 5, False, 0.0)
    return scheduler


def test_drafts_join_the_cache_only_as_far_as_they_are_accepted():
    scheduler = generating_scheduler(1, per_slot_streams=False)
    slot = scheduler.slots[0]
    step = scheduler.schedule(64, 64)
    assert slot.phase is SlotPhase.GENERATING and slot.n_in_cache == 4
    scheduler.add_drafts(step, {0: [6, 7, 8]}, 3)
    (run,) = step.runs
    assert run.tokens == [5, 6, 7, 8] and run.draft == 3 and run.filler == 0
    assert step.n_extra == 3 and step.n_tokens == 4
    scheduler.advance(step)
    assert slot.n_in_cache == 5  # the slot's own token; drafts wait for the sampler
    # Two drafts agreed, then the sampler's own token.
    outputs = PendingOutputs()
    scheduler.update([Sampled(slot, [6, 7, 9], [False] * 3)], 0.0, outputs)
    assert [chunk.token_ids for chunk in outputs.to(b"g").tokens] == [[6], [7], [9]]
    assert slot.n_in_cache == 7 == len(slot.tokens) - 1


def test_an_end_inside_agreed_drafts_cuts_there():
    """max_tokens reached at the first agreed draft: the rest is not recorded, and only the
    cells of what was recorded hold."""
    scheduler = generating_scheduler(1, per_slot_streams=False)
    slot = scheduler.slots[0]
    slot.occupant.params = SamplingParams(max_tokens=2, temperature=0.0)
    step = scheduler.schedule(64, 64)
    scheduler.add_drafts(step, {0: [6, 7, 8]}, 3)
    scheduler.advance(step)
    assert scheduler.room(slot) == 1
    outputs = PendingOutputs()
    scheduler.update([Sampled(slot, [6, 7, 9], [False] * 3)], 0.0, outputs)
    assert [chunk.token_ids for chunk in outputs.to(b"g").tokens] == [[6]]
    assert slot.finish_reason is FinishReason.LENGTH and slot.tokens[-2:] == [5, 6]
    assert slot.n_in_cache == 5 == len(slot.tokens) - 1


def test_with_a_stream_per_slot_every_decode_run_gets_the_same_length():
    scheduler = generating_scheduler(3, per_slot_streams=True)
    step = scheduler.schedule(64, 64)
    assert step.ubatches == 1
    assert scheduler.ubatches_with_filler(step, 4) == 1
    scheduler.add_drafts(step, {1: [6, 7]}, 4)
    assert [len(run.tokens) for run in step.runs] == [5, 5, 5]
    assert [(run.draft, run.filler) for run in step.runs] == [(0, 4), (2, 2), (0, 4)]
    assert step.n_extra == 12 and step.ubatches == 1
    scheduler.advance(step)
    assert [slot.n_in_cache for slot in scheduler.slots] == [5, 5, 5]


# --- the per-request opt-out ---------------------------------------------------------------


def test_a_request_body_opts_out_of_drafts_through_the_gateway():
    from loomserve.gateway.api.schemas import ChatCompletionRequest, CompletionRequest
    from loomserve.gateway.request.params import sampling_params

    out = CompletionRequest(model="m", prompt="hi", speculative=False)
    assert sampling_params(out, 16, None).speculative is False
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert sampling_params(chat, 16, None).speculative is True
