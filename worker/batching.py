"""A step's runs written into the engine's batch, each the way its logits are read back."""

from __future__ import annotations

from dataclasses import dataclass, field

from loomserve.worker.engine import TokenBatch
from loomserve.worker.slots import Run, Slot, Step


@dataclass(slots=True)
class Filled:
    """What the batch holds beyond its tokens: who samples where, and the runs read their own
    way (drafts to verify, a prompt to score)."""

    sampled: list[tuple[Slot, int]] = field(default_factory=list)  # batch indices, batch order
    verified: dict[int, Run] = field(default_factory=dict)  # decode runs with extra tokens
    scoring: Step | None = None  # the step, when a run scores its prompt


def fill_batch(batch: TokenBatch, step: Step) -> Filled:
    """Fill the engine's batch from the runs, in their order; the slots to sample and their
    batch indices come back in batch order (the order of the output logits' rows)."""
    batch.clear()
    filled = Filled()
    for run in step.runs:
        seq = run.slot.index
        if run.filler and run.pad:  # padding grown to the tick's draft length
            last = batch.add_run(run.tokens, run.start, seq, False)
        elif run.draft or run.filler:  # its token, its drafts (logits on each), filler
            last = batch.add_verified_run(run.tokens, run.start, seq, 1 + run.draft)
            filled.verified[seq] = run
        elif run.score:  # a prompt being scored: logits on every token (scoring.py)
            last = batch.add_run(run.tokens, run.start, seq, True, logits_on_all=True)
            filled.scoring = step
        elif len(run.tokens) == 1:  # a decode token: the cheaper single add
            last = batch.add(run.tokens[0], run.start, seq, run.sample)
        else:
            last = batch.add_run(run.tokens, run.start, seq, run.sample)
        if run.sample:
            filled.sampled.append((run.slot, last))
    return filled
