"""SQLite persistence: organisations, API keys, conversations and the usage ledger.

`Store` is the only object that runs SQL; everything else imports the value types from here.
"""

from store.store import UNSET, Store
from store.types import (
    ApiKey,
    Conflict,
    Conversation,
    FileQuery,
    FileQuota,
    Message,
    NotFound,
    Org,
    Principal,
    QuotaExceeded,
    RequestRecord,
    RequestStatus,
    StoreError,
    StoreUnavailable,
    StoredFile,
)

__all__ = [
    "UNSET",
    "ApiKey",
    "Conflict",
    "Conversation",
    "FileQuery",
    "FileQuota",
    "Message",
    "NotFound",
    "Org",
    "Principal",
    "QuotaExceeded",
    "RequestRecord",
    "RequestStatus",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "StoredFile",
]
