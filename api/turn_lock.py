"""One turn at a time per stored conversation.

A turn reads the conversation's history, answers, and appends itself; two turns of one
conversation at once (two tabs, two API clients, a retry racing its original) would store an
answer after a history it never saw, or two answers to one question in a row. So a request
that will store a turn holds its conversation from before it reads the history until its turn
is stored or dropped, and so does a cut of the conversation (regenerate, edit). One that
finds the conversation held waits up to WAIT_S (the web UI stops a stream and at once sends
the regenerated turn: the stopped one needs a moment to store its cut answer), then gets a
400 `conversation_locked`, as OpenAI's Conversations API answers. In-process: the store's lock
(store/lock.py) makes this process the only writer of its database.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from api.errors import ApiError, bad_request

WAIT_S = 5.0  # how long a request waits for the turn before it in the same conversation


def conversation_locked(param: str | None) -> ApiError:
    return bad_request(
        "Another request is answering in this conversation. Try again once it has finished.",
        code="conversation_locked",
        param=param,
    )


class TurnLocks:
    def __init__(self) -> None:
        self._held: dict[tuple[str, str], asyncio.Event] = {}  # (org, conversation) -> set when released

    def is_held(self, org_id: str, conversation_id: str) -> bool:
        return (org_id, conversation_id) in self._held

    def try_acquire(self, org_id: str, conversation_id: str) -> Callable[[], None] | None:
        """Hold the conversation if no turn holds it now (its release), else None at once."""
        key = (org_id, conversation_id)
        if key in self._held:
            return None
        return self._hold(key)

    async def acquire(self, org_id: str, conversation_id: str, *, param: str | None) -> Callable[[], None]:
        """Hold the conversation, waiting up to WAIT_S for a turn in progress; returns its
        release (idempotent), to be called on the holder's one way out."""
        key = (org_id, conversation_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while (held := self._held.get(key)) is not None:
            try:
                await asyncio.wait_for(held.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise conversation_locked(param) from None
        return self._hold(key)

    def _hold(self, key: tuple[str, str]) -> Callable[[], None]:
        released = asyncio.Event()
        self._held[key] = released

        def release() -> None:
            if self._held.get(key) is released:
                del self._held[key]
                released.set()

        return release
