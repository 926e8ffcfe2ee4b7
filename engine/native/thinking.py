"""A sequence's thinking budget (SamplingParams.thinking): counts the tokens it spends inside
its thinking blocks and, once the budget is spent, names the tokens the sampler must pick.

Torch-free. The sequence feeds it every token it appends; the runner asks it, before each
step's sampling, for the token that step is forced to (the sampler masks every other one).
"""

from __future__ import annotations

from engine.types import ThinkingBudget


class ThinkingState:
    __slots__ = ("budget", "inside", "used", "forcing")

    def __init__(self, budget: ThinkingBudget):
        self.budget = budget
        self.inside = budget.opened  # within a thinking block
        self.used = 0  # thinking tokens generated so far, all blocks together
        self.forcing: int | None = None  # index into forced_ids of the next forced token
        if self.inside:
            self._maybe_force()

    def forced_token(self) -> int | None:
        """The token the next sampled position must take, if any."""
        return None if self.forcing is None else self.budget.forced_ids[self.forcing]

    def observe(self, token_id: int) -> None:
        """A token was appended to the sequence (sampled, or forced)."""
        if self.forcing is not None:
            self.forcing += 1
            if self.forcing == len(self.budget.forced_ids):  # the closing tag went out
                self.forcing = None
                self.inside = False
            return
        if not self.inside:
            if token_id == self.budget.open_id:
                self.inside = True
                self._maybe_force()
            return
        if token_id == self.budget.close_id:  # the model closed the block itself
            self.inside = False
            return
        self.used += 1
        self._maybe_force()

    def _maybe_force(self) -> None:
        if self.used >= self.budget.max_tokens and self.budget.forced_ids:
            self.forcing = 0
