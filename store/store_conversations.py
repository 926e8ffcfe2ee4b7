"""`StoreConversations`: the `Store` methods for conversations, searching them, their share links,
feedback on their answers, the Responses stored with them, and purging deleted ones (a mixin:
`Store` subclasses it).

Each method is one read on a read connection or one job for the single writer, through the
`_reader` and `_write` that `Store` (store/store.py) provides; the SQL is in store/conversations.py,
store/search.py, store/shares.py, store/feedback.py and store/responses.py. It holds no state and
opens no connection of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import Any

import aiosqlite
import structlog

from settings import StoreConfig
from store import conversations, feedback, responses, search, shares
from store.types import (
    Conversation,
    ConversationHit,
    ImportedConversation,
    Message,
    Share,
    ShareSnapshot,
    StoreError,
)
from store.writer import Job, T

log = structlog.get_logger(__name__)


class StoreConversations:
    config: StoreConfig

    async def _write(self, job: Job[T]) -> T:
        raise NotImplementedError  # Store's: a job for the single writer

    def _reader(self) -> contextlib.AbstractAsyncContextManager[aiosqlite.Connection]:
        raise NotImplementedError  # Store's: a connection from the read pool

    # --- conversations -------------------------------------------------------------------

    async def create_conversation(
        self,
        org_id: str,
        *,
        title: str | None = None,
        pending: bool = False,
        metadata: dict[str, str] | None = None,
        messages: tuple[Message, ...] = (),
    ) -> Conversation:
        """A conversation, starting with `messages` (oldest first; one transaction); without a title
        it takes the first user message's. `pending`: created for a turn not yet stored; deleted at
        the next start if it never is."""
        job = functools.partial(
            conversations.create, org_id=org_id, title=title, pending=pending, metadata=metadata, messages=messages
        )
        return await self._write(job)

    async def import_conversations(self, org_id: str, imported: list[ImportedConversation]) -> list[Conversation]:
        """Store conversations read from an export under new ids, in one transaction: all of them
        or, on any failure, none. Returned in the same order, without their messages."""
        return await self._write(functools.partial(conversations.insert_imported, org_id=org_id, imported=imported))

    async def branch_conversation(
        self,
        org_id: str,
        conversation_id: str,
        num_messages: int,
        *,
        pending: bool = False,
        title: str | None = None,
        last_message_id: str | None = None,
    ) -> Conversation | None:
        """A new conversation holding a copy of the first `num_messages` messages of this one, in one
        transaction (a Responses call continuing from an earlier response, the web UI's "Branch");
        titled `title` (None: the source's); None if it is gone or shorter, or its last copied message is
        not `last_message_id` (when given)."""
        job = functools.partial(
            conversations.branch,
            org_id=org_id,
            conversation_id=conversation_id,
            num_messages=num_messages,
            pending=pending,
            title=title,
            last_message_id=last_message_id,
        )
        return await self._write(job)

    async def delete_pending_conversations(self) -> int:
        """At startup: drop conversations whose creating request died before its first turn."""
        return await self._write(conversations.delete_pending)

    async def list_conversations(
        self, org_id: str, *, limit: int = 20, after: str | None = None
    ) -> tuple[list[Conversation], bool]:
        """A page, newest first, and whether more follow; raises NotFound for an unknown `after`."""
        async with self._reader() as conn:
            return await conversations.list_page(conn, org_id, max(1, limit), after)

    async def list_conversations_created(
        self, org_id: str, *, limit: int, before: tuple[float, str] | None = None
    ) -> list[Conversation]:
        """A page of live conversations, newest created first, after `before` (the previous page's
        last created_at and id); stable under new turns, for reading them all (the export)."""
        async with self._reader() as conn:
            return await conversations.list_created_page(conn, org_id, max(1, limit), before)

    async def search_conversations(
        self, org_id: str, text: str, *, limit: int = 20, after: str | None = None
    ) -> tuple[list[ConversationHit], bool]:
        """A page of the conversations whose title or messages contain `text` (literal, no NUL),
        in the list's order, and whether more follow; raises NotFound for an unknown `after`."""
        async with self._reader() as conn:
            return await search.search_page(conn, org_id, text, max(1, limit), after)

    async def get_conversation(
        self, org_id: str, conversation_id: str, *, with_messages: bool = True
    ) -> Conversation | None:
        async with self._reader() as conn:
            return await conversations.get(conn, org_id, conversation_id, with_messages)

    async def get_billed_conversation(
        self, org_id: str, conversation_id: str
    ) -> tuple[Conversation, dict[str, conversations.AnswerUsage]] | None:
        """The conversation with its messages, and each answer's ledger row by message id."""
        async with self._reader() as conn:
            return await conversations.get_billed(conn, org_id, conversation_id)

    async def conversation_bytes(self, org_id: str) -> int:
        """What the organisation's live conversations hold (their messages' text and parts), and its
        share links' snapshots."""
        async with self._reader() as conn:
            return await conversations.stored_bytes(conn, org_id)

    async def rename_conversation(self, org_id: str, conversation_id: str, title: str) -> Conversation | None:
        return await self.update_conversation(org_id, conversation_id, title=title, metadata=None, set_metadata=False)

    async def update_conversation(
        self,
        org_id: str,
        conversation_id: str,
        *,
        title: str | None,
        metadata: dict[str, str] | None,
        set_metadata: bool,
    ) -> Conversation | None:
        """The title (None: unchanged) and, with `set_metadata`, the metadata; None if not found."""
        job = functools.partial(
            conversations.update,
            org_id=org_id,
            conversation_id=conversation_id,
            title=title,
            metadata=metadata,
            set_metadata=set_metadata,
        )
        return await self._write(job)

    async def discard_pending_conversation(self, org_id: str, conversation_id: str) -> bool:
        """Delete at once (not a soft delete kept for the retention period) a conversation made
        for a request refused before its first turn was stored; False if it got a turn since."""
        job = functools.partial(conversations.discard_pending, org_id=org_id, conversation_id=conversation_id)
        return await self._write(job)

    async def delete_conversation(self, org_id: str, conversation_id: str) -> bool:
        job = functools.partial(conversations.soft_delete, org_id=org_id, conversation_id=conversation_id)
        return await self._write(job)

    async def truncate_conversation(self, org_id: str, conversation_id: str, keep_messages: int) -> bool:
        """Keep the first `keep_messages` messages, drop the rest (regenerate, edit and resend)."""
        job = functools.partial(
            conversations.truncate, org_id=org_id, conversation_id=conversation_id, keep_messages=keep_messages
        )
        return await self._write(job)

    # --- share links (store/shares.py) ----------------------------------------------------

    async def create_share(self, org_id: str, conversation_id: str, snapshot: ShareSnapshot) -> Share | None:
        """A new link to `snapshot` of the organisation's conversation; None when it is not live."""
        job = functools.partial(shares.insert, org_id=org_id, conversation_id=conversation_id, snapshot=snapshot)
        return await self._write(job)

    async def replace_share_snapshot(self, org_id: str, share_id: str, snapshot: ShareSnapshot) -> Share | None:
        """The share's snapshot taken again, its link unchanged; None when the share is gone."""
        return await self._write(
            functools.partial(shares.replace_snapshot, org_id=org_id, share_id=share_id, snapshot=snapshot)
        )

    async def get_share(self, org_id: str, share_id: str) -> Share | None:
        async with self._reader() as conn:
            return await shares.get(conn, org_id, share_id)

    async def list_shares(
        self, org_id: str, *, conversation_id: str | None = None, limit: int = 20, after: str | None = None
    ) -> tuple[list[Share], bool]:
        """A page, newest first, and whether more follow; raises NotFound for an unknown `after`."""
        async with self._reader() as conn:
            return await shares.list_page(conn, org_id, conversation_id, max(1, limit), after)

    async def delete_share(self, org_id: str, share_id: str) -> bool:
        return await self._write(functools.partial(shares.delete, org_id=org_id, share_id=share_id))

    async def shared_snapshot(self, token: str) -> str | None:
        """The public read by a link's token: its snapshot JSON, or None (unknown, revoked, deleted)."""
        async with self._reader() as conn:
            return await shares.snapshot_by_token(conn, token)

    # --- feedback on answers -------------------------------------------------------------

    async def set_feedback(
        self, org_id: str, conversation_id: str, message_id: str, change: feedback.FeedbackChange
    ) -> feedback.Feedback:
        """Rate or comment an answer, or record that it was regenerated or its prompt edited;
        NotFound when the conversation or answer does not exist for this organisation."""
        job = functools.partial(
            feedback.upsert, org_id=org_id, conversation_id=conversation_id, message_id=message_id, change=change
        )
        return await self._write(job)

    async def conversation_feedback(self, conversation_id: str) -> dict[str, feedback.Feedback]:
        """message id -> feedback, for one conversation (the caller checked its organisation)."""
        async with self._reader() as conn:
            return await feedback.for_conversation(conn, conversation_id)

    async def export_feedback(self, org_id: str | None = None) -> list[feedback.Feedback]:
        async with self._reader() as conn:
            return [row async for row in feedback.iterate(conn, org_id)]

    # --- stored Responses (tied to their conversation) -----------------------------------

    async def insert_response(self, org_id: str, response: responses.StoredResponse) -> None:
        await self._write(functools.partial(responses.insert, org_id=org_id, response=response))

    async def update_response(
        self, org_id: str, response_id: str, *, status: str, body_json: str, num_messages: int | None = None
    ) -> bool:
        return await self._write(
            functools.partial(
                responses.update,
                org_id=org_id,
                response_id=response_id,
                status=status,
                body_json=body_json,
                num_messages=num_messages,
            )
        )

    async def fail_unfinished_responses(self, error: dict[str, Any]) -> int:
        return await self._write(functools.partial(responses.fail_unfinished, error=error))

    async def get_response(self, org_id: str, response_id: str) -> responses.StoredResponse | None:
        async with self._reader() as conn:
            return await responses.get(conn, org_id, response_id)

    async def delete_response(self, org_id: str, response_id: str) -> bool:
        return await self._write(functools.partial(responses.delete, org_id=org_id, response_id=response_id))

    # --- purging deleted conversations ---------------------------------------------------

    async def purge_deleted(self, retention_days_by_tier: dict[str, int], now: float | None = None) -> int:
        now = time.time() if now is None else now
        job = functools.partial(conversations.purge, retention_days_by_tier=dict(retention_days_by_tier), now=now)
        count = await self._write(job)
        if count:
            log.info("conversations_purged", num_conversations=count)
        return count

    async def run_purge_loop(self, retention_days_by_tier: dict[str, int]) -> None:
        """Purge every `purge_interval_s` until cancelled (run it as a background task)."""
        while True:
            try:
                await self.purge_deleted(retention_days_by_tier)
            except StoreError as exc:
                log.warning("conversation_purge_failed", error=str(exc))
            await asyncio.sleep(self.config.purge_interval_s)
