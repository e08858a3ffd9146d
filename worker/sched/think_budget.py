"""A thinking budget: after a request has thought `budget` tokens, its think block is closed
by writing the model's own end marker in place of the tokens it samples, so that the answer
still comes within max_tokens (llama-server's --reasoning-budget, vLLM's
thinking_token_budget).

Pure: the loop hands each sampled token to `steer` and sends what it returns. Thinking is
counted from the block's start marker, or from the first token where the prompt opened the
block; a reply that closes the block by itself, or never opens it, is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ThinkBudget:
    """One request's thinking budget and where its reply stands."""

    budget: int  # tokens of thinking allowed
    start: list[int]  # the tokens that open the block; empty: the prompt opened it
    end: list[int]  # the tokens that close it, written once the budget is spent
    spent: int = 0
    inside: bool = False
    done: bool = False
    forcing: int = 0  # how many of `end` were written so far (once spent)
    _recent: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.inside = not self.start

    def steer(self, token: int) -> int:
        """The token the reply gets in place of the sampled `token`."""
        if self.done:
            return token
        if self.forcing:
            return self._force()
        if not self.inside:
            if self._saw(token, self.start):
                self.inside = True
                self._recent.clear()
            return token
        if self.spent >= self.budget:
            return self._force()
        self.spent += 1
        if self._saw(token, self.end):
            self.done = True  # the model closed the block itself
        return token

    def _force(self) -> int:
        token = self.end[self.forcing]
        self.forcing += 1
        self.done = self.forcing == len(self.end)
        return token

    def _saw(self, token: int, marker: list[int]) -> bool:
        """Whether the reply's last tokens, `token` included, are `marker`."""
        recent = self._recent
        recent.append(token)
        del recent[: max(0, len(recent) - len(marker))]
        return recent == marker
