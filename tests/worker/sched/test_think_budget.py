"""The thinking budget's steering (worker/sched/think_budget.py): pure, on token ids."""

from __future__ import annotations

from loomserve.worker.sched.think_budget import ThinkBudget

START, END = [90, 91], [92, 93, 94]  # multi-token markers, as on a model without special ones


def steer(budget: ThinkBudget, sampled: list[int]) -> list[int]:
    return [budget.steer(token) for token in sampled]


def test_an_opened_block_is_closed_after_the_budget():
    """The prompt opened the block: the first 3 tokens think, then the end marker is written
    over what is sampled, token by token, then the answer is left alone."""
    budget = ThinkBudget(3, [], END)
    assert steer(budget, [1, 2, 3, 4, 5, 6, 7, 8]) == [1, 2, 3, *END, 7, 8]
    assert budget.done


def test_thinking_counts_from_the_start_marker():
    budget = ThinkBudget(2, START, END)
    sampled = [5, 90, 91, 1, 2, 3, 3, 3, 4]
    assert steer(budget, sampled) == [5, 90, 91, 1, 2, *END, 4]


def test_a_block_closed_by_the_model_is_left_alone():
    budget = ThinkBudget(4, [], END)
    sampled = [1, 92, 93, 94, 6, 7, 8, 9]  # closed after 4 tokens: within the budget
    assert steer(budget, sampled) == sampled and budget.done


def test_a_reply_that_never_opens_the_block_is_left_alone():
    budget = ThinkBudget(1, START, END)
    sampled = [1, 2, 90, 3, 91, 4, 5]  # the start marker's tokens, never in a row
    assert steer(budget, sampled) == sampled and not budget.inside


def test_a_budget_spent_inside_a_cut_marker_still_writes_it_whole():
    budget = ThinkBudget(2, [], END)
    assert steer(budget, [1, 92, 7, 7, 7, 8]) == [1, 92, *END, 8]
