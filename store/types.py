"""Value types and errors of the store: what callers get back, never database rows.

Times are unix seconds (float); ids are prefixed strings (`org_`, `key_`, `conv_`, `msg_`).
Nothing here touches SQLite.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class StoreError(Exception):
    """Base of every error the store raises on purpose."""


class StoreUnavailable(StoreError):
    """The database cannot be written (disk full, read-only, locked) or the store is closed.

    Nothing was committed for the call that raised it; the HTTP layer answers 503.
    """


class NotFound(StoreError):
    """The object does not exist, or belongs to another organisation (HTTP 404)."""


class Conflict(StoreError):
    """A unique name is already taken (HTTP 409)."""


class RequestStatus(enum.Enum):
    FINISHED = "finished"  # stop or length: the answer was delivered whole
    ABORTED = "aborted"  # client gone or stop button: billed for the tokens generated
    ERROR = "error"  # engine fault after admission
    FILTERED = "filtered"  # the safety gate ended or refused the answer


@dataclass(frozen=True, slots=True)
class Org:
    id: str
    name: str
    tier: str
    budget_usd: float | None  # per calendar month (UTC); None: no budget
    limits: dict[str, Any] = field(default_factory=dict)  # per-org overrides of tier limits, by setting name
    created_at: float = 0.0


INFERENCE_SCOPE = "inference"  # the API: chat, models, conversations, files, usage of its own organisation
ADMIN_SCOPE = "admin"  # /v1/admin/ only: organisations, keys, usage of every organisation
KEY_SCOPES = (INFERENCE_SCOPE, ADMIN_SCOPE)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key as it may be shown: never the secret, never its hash."""

    id: str
    org_id: str
    prefix: str  # the first characters of the secret, unique, used to name the key
    last4: str
    name: str | None
    created_at: float
    last_used_at: float | None
    revoked_at: float | None
    expires_at: float | None = None  # None: never expires
    scope: str = INFERENCE_SCOPE  # one of KEY_SCOPES

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    def is_expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    @property
    def display(self) -> str:
        return f"{self.prefix}...{self.last4}"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a key of an organisation, or the keyless local organisation."""

    key_id: str | None
    org: Org
    scope: str = INFERENCE_SCOPE  # the key's; the keyless local organisation's is inference

    @property
    def is_admin(self) -> bool:
        return self.scope == ADMIN_SCOPE


@dataclass(frozen=True, slots=True)
class Message:
    id: str
    role: str
    content: str
    created_at: float
    tokens: int | None = None  # completion tokens of an assistant message; None for others
    model: str | None = None  # the model that wrote an assistant message
    parts_json: str | None = None  # the content parts it was sent with (files, images); None: text only
    finish_reason: str | None = None  # assistant messages: why the answer ended (stop, length, content_filter)


@dataclass(frozen=True, slots=True)
class Conversation:
    id: str
    org_id: str
    title: str | None
    created_at: float
    updated_at: float
    messages: tuple[Message, ...] = ()  # oldest first; empty when listed
    metadata: dict[str, str] = field(default_factory=dict)  # OpenAI's: at most 16 string pairs


@dataclass(frozen=True, slots=True)
class ImportedConversation:
    """A conversation read from an export, to be stored under a new id (and its messages under
    theirs): its title, metadata and times as the file gives them; messages oldest first."""

    title: str | None
    created_at: float
    updated_at: float
    metadata: dict[str, str]
    messages: tuple[Message, ...]


@dataclass(frozen=True, slots=True)
class ConversationHit:
    """A conversation that search found: its latest message holding the text, and that message's
    text around the match (plain text, whitespace collapsed); both None when only its title did."""

    conversation: Conversation
    message_id: str | None
    snippet: str | None


@dataclass(frozen=True, slots=True)
class ShareSnapshot:
    """What a share link shows, as taken from a conversation: its public JSON and what it covers."""

    title: str | None
    num_messages: int  # the conversation's first messages it covers
    last_message_id: str  # the last of them
    snapshot_json: str  # GET /v1/shared/{token}'s body, served as it is
    taken_at: float


@dataclass(frozen=True, slots=True)
class Share:
    """A share link as its organisation sees it (never the snapshot's text)."""

    id: str  # 'share_' + 24 hex digits
    org_id: str
    conversation_id: str
    token: str  # the link's secret: /share/{token}
    title: str | None
    num_messages: int
    last_message_id: str
    created_at: float
    snapshot_at: float  # when the snapshot was taken (again, by an update)
    num_chars: int  # the snapshot's size, counted against the conversation storage


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Everything written when a request ends: one ledger row and, with a conversation, its turn."""

    request_id: str
    org_id: str
    key_id: str | None
    model: str
    tier: str
    status: RequestStatus
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float
    queue_ms: float | None
    ttft_ms: float | None
    total_ms: float | None
    created_at: float
    finished_at: float
    conversation_id: str | None = None
    new_messages: tuple[tuple[str, str], ...] = ()  # (role, content) sent with this request
    assistant_content: str | None = None  # None: no assistant message is stored
    fallback_from: str | None = None  # the model first chosen, when the router fell back
    new_message_parts: tuple[str | None, ...] = ()  # per new message: its parts as JSON, or None
    usage_source: str = "engine"  # who counted the tokens: engine, upstream, tokenizer or estimate
    finish_reason: str | None = None  # of the stored assistant message
    reasoning_tokens: int = 0  # of completion_tokens, a reasoning model's thinking
    fallback_reason: str | None = None  # with fallback_from: busy, unavailable or over_budget
    history_messages_dropped: int = 0  # the conversation's oldest messages left out of the prompt


class QuotaExceeded(StoreError):
    """An organisation's file quota (count or bytes) would be passed; nothing was written."""


@dataclass(frozen=True, slots=True)
class StoredFile:
    """An uploaded file's metadata; its bytes live on disk under the files folder, by id."""

    id: str  # 'file-' + 24 hex digits
    org_id: str
    filename: str
    purpose: str
    bytes: int
    sha256: str  # hex digest of the content
    media_type: str
    created_at: float
    expires_at: float | None  # None: kept until deleted


@dataclass(frozen=True, slots=True)
class FileQuota:
    max_files: int
    max_bytes: int


@dataclass(frozen=True, slots=True)
class FileQuery:
    """Filters and paging of a file listing; `after` is the last id of the previous page."""

    limit: int = 10_000
    purpose: str | None = None
    after: str | None = None
    ascending: bool = False
