"""A sequence's thinking (SamplingParams.thinking): counts the tokens it spends inside its
thinking blocks and, once a budget is spent, names the tokens the sampler must pick; says
which tokens are thinking, so that a grammar constrains only the answer after them.

Torch-free. The sequence feeds it every token it appends; the runner asks it, before each
step's sampling, for the token that step is forced to (the sampler masks every other one) and
whether the step samples thinking (no grammar mask; the model's own start may open a block).
"""

from __future__ import annotations

from engine.types import ThinkingBudget


class ThinkingState:
    __slots__ = ("budget", "inside", "used", "forcing", "num_seen", "reopens")

    def __init__(self, budget: ThinkingBudget, *, reopens: bool = True):
        self.budget = budget
        # False under a grammar: only the answer's first token may open a block (later, the
        # opening tag's id may be the grammar's own text and must not switch the grammar off).
        self.reopens = reopens
        self.inside = budget.opened  # within a thinking block
        self.used = 0  # thinking tokens generated so far, all blocks together
        self.forcing: int | None = None  # index into forced_ids of the next forced token
        self.num_seen = 0  # tokens observed
        if self.inside:
            self._maybe_force()

    def forced_token(self) -> int | None:
        """The token the next sampled position must take, if any."""
        return None if self.forcing is None else self.budget.forced_ids[self.forcing]

    @property
    def samples_thinking(self) -> bool:
        """The next token is thinking (or may open it: the answer's first token)."""
        return self.inside or self.num_seen == 0

    def observe(self, token_id: int) -> bool:
        """A token was appended to the sequence (sampled, or forced); whether it was thinking
        (the tags included)."""
        self.num_seen += 1
        if self.forcing is not None:
            self.forcing += 1
            if self.forcing == len(self.budget.forced_ids):  # the closing tag went out
                self.forcing = None
                self.inside = False
            return True
        if not self.inside:
            if token_id == self.budget.open_id and (self.reopens or self.num_seen == 1):
                self.inside = True
                self._maybe_force()
                return True
            return False
        if token_id == self.budget.close_id:  # the model closed the block itself
            self.inside = False
            return True
        self.used += 1
        self._maybe_force()
        return True

    def _maybe_force(self) -> None:
        cap = self.budget.max_tokens
        if cap is not None and self.used >= cap and self.budget.forced_ids:
            self.forcing = 0
