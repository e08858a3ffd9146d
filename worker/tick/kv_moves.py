"""The engine work an admission asks for: moving a sequence's KV cells between slots, host
memory and the RAM cache (`--swap-space`, `--cache-ram`).

The scheduler decides (Admission, Preemption); this does what the decision implies to the
engine and tells the scheduler when it could not (prefix_lost), so the loop admits in one line.
"""

from __future__ import annotations

import structlog

from ..cache.ram_cache import RamEntry
from ..engine.engine import Engine
from ..sched.scheduler import Scheduler
from ..sched.slots import Admission, Preemption

log = structlog.get_logger("loomserve.worker.tick.loop")  # the logger these lines always had


class KvMoves:
    """Swap-out, RAM-cache saves and restores, prefix keeps and copies for admitted slots."""

    def __init__(self, engine: Engine, scheduler: Scheduler) -> None:
        self.engine = engine
        self.scheduler = scheduler

    def place(self, admission: Admission) -> None:
        """Give the admitted slot its cells: kept, copied, restored or none (then the whole
        sequence is evaluated); first save what the slot held if that is worth keeping."""
        swapped = False
        if admission.preempted is not None:
            swapped = self.swap_out(admission.preempted)
        slot, reused = admission.slot.index, admission.reused
        media = admission.request.media  # the reused prefix's images are its images
        if admission.save_first is not None and not swapped:
            self.save_to_ram(slot, admission.save_first)
        if admission.restore is not None:
            self.engine.drop_sequence(slot)
            if not self.engine.restore_sequence(slot, admission.restore):
                log.warning("could not restore a swapped-out request; recomputing it")
                self.engine.drop_sequence(slot)
                self.scheduler.prefix_lost(admission)
        elif admission.ram_entry is not None:
            self.restore_from_ram(admission, admission.ram_entry)
        elif admission.source is not None:
            self.engine.drop_sequence(slot)
            self.engine.copy_prefix(admission.source.index, slot, reused, media)
        elif not self.engine.keep_prefix(slot, reused, media):
            # This cache cannot keep a part of a sequence: evaluate the whole prompt.
            self.engine.drop_sequence(slot)
            self.scheduler.prefix_lost(admission)

    def swap_out(self, preemption: Preemption) -> bool:
        """Save a preempted request's cells to host memory if the swap space holds them; else
        it recomputes them when it resumes (the slot keeps them meanwhile, as a prefix, and
        the RAM cache may take them). True when they were saved."""
        seq = preemption.slot.index
        if not preemption.n_cached or not self.scheduler.swap.fits(self.engine.state_size(seq)):
            return False
        state = self.engine.save_sequence(seq)
        if state is None:
            return False
        self.scheduler.swap_out(preemption, state, len(state))
        return True

    def save_to_ram(self, seq: int, tokens: list[int]) -> None:
        """Keep a slot's cells in the RAM cache before the slot is used for another request."""
        ram, engine = self.scheduler.ram, self.engine
        # The cells must be exactly these tokens: a slot that holds more or fewer is not saved.
        if engine.seq_pos_max(seq) != len(tokens) - 1 or not ram.fits(engine.state_size(seq)):
            return
        state = engine.save_sequence(seq)
        if state is not None:
            ram.put(tokens, state, len(state))

    def restore_from_ram(self, admission: Admission, entry: RamEntry) -> None:
        """Load a RAM-cached sequence (the admission's ram_entry) into the admitted slot and
        keep its shared prefix."""
        slot, reused = admission.slot.index, admission.reused
        self.engine.drop_sequence(slot)
        if self.engine.restore_sequence(slot, entry.state) and self.engine.keep_prefix(
            slot, reused, admission.request.media
        ):
            self.scheduler.ram.restored(entry, reused)
            return
        log.warning("could not restore a RAM-cached prompt; evaluating it")
        self.engine.drop_sequence(slot)
        self.scheduler.prefix_lost(admission)
