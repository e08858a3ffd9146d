"""Speculation in the tick: generating slots draft tokens (speculation.py proposes them, purely)
that ride in the tick's one forward pass, and the samplers verify them as they sample.

The loop calls speculate(step) after planning, sample_verified() when the step carries drafts
and settle() after the scheduler's update; the scheduler shapes the drafts into the batch
(shaping.py) and keeps, in its update, the ones the samplers agreed with.
"""

from __future__ import annotations

import numpy as np

from ..config import WorkerConfig
from ..engine.engine import Engine
from ..sampling.logprobs import sampled
from ..sched.records import SpecCounts
from ..sched.scheduler import Scheduler
from ..sched.slots import Run, Sampled, Slot, Step
from ..sched.speculation import Proposal, SpecSettings, Speculator
from ..sched.strategies import SlotPhase
from ..sched.tick_cost import WARM_UP_TICKS, TickCostModel
from ..sched.ubatches import SplitRules


def make_speculator(config: WorkerConfig, split_rules: SplitRules) -> Speculator | None:
    # Rejected drafts must be cut from a sequence again: no recurrent state.
    if not config.speculates or not split_rules.padding:
        return None
    settings = SpecSettings(
        config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
    )
    return Speculator(settings, config.slots)


class Drafting:
    """Drafts for a tick's generating slots where they pay, and their verification."""

    def __init__(
        self,
        engine: Engine,
        scheduler: Scheduler,
        speculator: Speculator | None,
        tick_cost: TickCostModel,
        config: WorkerConfig,
    ) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.speculator = speculator
        self.tick_cost = tick_cost
        self.batch_tokens = config.batch_tokens
        self.counts = SpecCounts()  # this tick's
        self._settling: list[Run] = []  # verified runs whose cells settle() trims

    def take_counts(self) -> SpecCounts:
        """This tick's counts, for its TickRecord; the next tick starts from zero."""
        counts, self.counts = self.counts, SpecCounts()
        return counts

    def speculate(self, step: Step) -> None:
        """Give generating slots drafts where the tick-cost model says they pay (speculation.py)."""
        spec = self.speculator
        # The cost model must have seen some ticks (not necessarily prompt chunks: the
        # prediction needed is for this tick's make-up, mostly decode tokens).
        if spec is None or not step.plan.decode or self.tick_cost.observations < WARM_UP_TICKS:
            return
        if any(run.score for run in step.runs):  # prompt scoring reads its rows its own way
            return
        context = self.engine.slot_context
        uniform = self.scheduler.split_rules.per_slot_streams
        proposals, growing, max_length = [], 0, spec.settings.max_tokens
        for run in step.runs:
            slot = run.slot
            if run.pad:
                growing += 1
                max_length = min(max_length, context - run.start - 1)
                continue
            if not (run.sample and slot.phase is SlotPhase.GENERATING):
                continue
            growing += 1
            max_length = min(max_length, context - run.start - 1)
            request = slot.occupant
            params = request.params
            # A thinking budget steers tokens one at a time (think_budget.py): no drafts. A
            # grammar's drafts are checked by it as they are verified (HostSampler.sample).
            may_draft = params.speculative and not params.think_budget
            if not may_draft or not request.chain.verifies_drafts:
                proposals.append(Proposal(slot.index, [], 0.0))
                continue
            proposal = spec.propose(slot.index, request, slot.tokens)
            # Drafts past max_tokens could never be kept (the token after them is sampled).
            left = min(params.max_tokens - request.completion_tokens, context - len(slot.tokens))
            if len(proposal.tokens) > left - 1:
                proposal = Proposal(slot.index, proposal.tokens[: max(0, left - 1)], proposal.rate)
            proposals.append(proposal)
        if max_length <= 0:
            return
        proposals = [
            Proposal(p.slot, p.tokens[:max_length], p.rate) if len(p.tokens) > max_length else p
            for p in proposals
        ]
        plan = step.plan
        predicted = self.tick_cost.predict(len(plan.decode), plan.n_tokens - len(plan.decode))

        def tick_seconds(extra: int) -> float:
            return predicted + spec.cost.predict(extra)

        def keeps_passes(length: int) -> bool:
            return self.scheduler.ubatches_with_filler(step, length) <= step.ubatches

        room = self.batch_tokens - step.n_tokens
        width = growing if uniform else 0
        length = spec.choose(
            proposals, room, tick_seconds, width, keeps_passes if uniform else lambda n: True
        )
        if length:
            drafts = {p.slot: p.tokens[:length] for p in proposals if p.tokens}
            self.scheduler.add_drafts(step, drafts, length)

    def sample_verified(
        self, sampling: list[tuple[Slot, int]], verified: dict[int, Run]
    ) -> list[Sampled]:
        """Sampling in a tick with drafts: a slot with drafts samples at its token and at
        each draft in turn while the drafts equal what it samples. The scheduler's update
        keeps them; settle() then drops the cells of the rest."""
        n_rows = sum(
            1 + verified[slot.index].draft if slot.index in verified else 1 for slot, _ in sampling
        )
        logits = self.engine.output_logits(n_rows)
        row, out = 0, []
        for slot, index in sampling:
            run = verified.get(slot.index)
            n_draft = run.draft if run is not None else 0
            block = logits[row : row + 1 + n_draft]
            row += 1 + n_draft
            drafts = run.tokens[1 : 1 + n_draft] if run is not None else []
            out.append(self._verify(slot, index, block, drafts))
        self._settling = list(verified.values())
        return out

    def settle(self) -> None:
        """After the scheduler's update: each verified slot's sequence is its cached
        tokens; the rest of its run's cells go."""
        for run in self._settling:
            media = run.slot.request.media if run.slot.request else ()
            self.engine.keep_prefix(run.slot.index, run.slot.n_in_cache, media)
        self._settling = []

    def _verify(self, slot: Slot, index: int, rows: np.ndarray, drafts: list[int]) -> Sampled:
        """Sample row by row (the row for the token at `index`, then one per draft) while
        each sampled token equals the next draft and the request can take more."""
        request = slot.occupant
        sampler = request.chain
        greedy = rows.argmax(axis=1).tolist() if sampler.plain_greedy else None
        room, ignore_eos = self.scheduler.room(slot), request.params.ignore_eos
        tokens: list[int] = []
        matched = 0
        for position in range(len(rows)):
            token = (
                greedy[position]
                if greedy is not None
                else sampler.sample(index + position, rows[position])
            )
            tokens.append(token)
            agrees = position < len(drafts) and token == drafts[position]
            matched += agrees
            ends = len(tokens) >= room or (self.engine.is_eog(token) and not ignore_eos)
            if not agrees or ends:
                break
        if drafts and self.speculator is not None:
            self.speculator.verified(slot.index, request, len(drafts), matched)
            self.counts.add(len(drafts), matched)
            request.drafted += len(drafts)
            request.drafts_accepted += matched
        context = self.engine.slot_context
        return sampled(slot, rows[: len(tokens)], tokens, self.engine.is_eog, context)
