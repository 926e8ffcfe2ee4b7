"""SQLite persistence: organisations, API keys, conversations and the usage ledger.

`Store` is the only object that runs SQL; everything else imports the value types from here.
"""

from store.store import UNSET, Store
from store.types import (
    ApiKey,
    Conflict,
    Conversation,
    Message,
    NotFound,
    Org,
    Principal,
    RequestRecord,
    RequestStatus,
    StoreError,
    StoreUnavailable,
)

__all__ = [
    "UNSET",
    "ApiKey",
    "Conflict",
    "Conversation",
    "Message",
    "NotFound",
    "Org",
    "Principal",
    "RequestRecord",
    "RequestStatus",
    "Store",
    "StoreError",
    "StoreUnavailable",
]
