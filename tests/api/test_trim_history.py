"""History trimming of a stored conversation: the fewest oldest exchanges dropped so that the
prompt fits, found with O(log turns) encodings (one encoding per dropped turn made a long
conversation cost seconds of CPU per request, quadratic in its length)."""

from __future__ import annotations

import math

import pytest

import api.prompt as prompt_module
from api.prompt import trim_history
from api.protocol import ChatMessage


def conversation(num_exchanges: int) -> list[ChatMessage]:
    out = [ChatMessage("system", "be kind")]
    for i in range(num_exchanges):
        out += [ChatMessage("user", f"q{i} " * 10), ChatMessage("assistant", f"a{i} " * 10)]
    return out


@pytest.mark.parametrize("budget", [10_000, 2_000, 700, 150, 5])
def test_the_fewest_oldest_exchanges_that_fit_are_dropped_with_few_encodings(monkeypatch, budget):
    calls = []

    def encode_chat(_model, context, *_args):
        calls.append(len(context))
        return [0] * sum(len(m.content) for m in context)  # one "token" per character

    monkeypatch.setattr(prompt_module, "encode_chat", encode_chat)
    history, new = conversation(200), (ChatMessage("user", "now"),)
    ids, context, dropped = trim_history(None, history, new, budget)  # type: ignore[arg-type]

    assert context[0] == history[0] and context[-1] == new[0]  # the system message and the question stay
    assert dropped % 2 == 0 and context[1:-1] == history[1 + dropped :]  # whole exchanges, oldest first
    fits = len(ids) <= budget
    if dropped < 400:  # not everything dropped: one exchange fewer would not have fit
        last_dropped = history[dropped - 1 : dropped + 1] if dropped else []
        assert fits and (dropped == 0 or len(ids) + sum(len(m.content) for m in last_dropped) > budget)
    assert len(calls) <= 2 + math.ceil(math.log2(201))
