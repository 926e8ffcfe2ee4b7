"""OpenAI's list endpoints: their query parameters (`limit`, `order`), checked in one place, and
the page they answer (list_body)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.errors import bad_request


def page_limit(query: Mapping[str, str], *, default: int, maximum: int) -> int:
    """`limit`: an integer from 1 to `maximum` (`default` when absent); else a 400 naming it."""
    text = query.get("limit", str(default))
    if not text.isdigit() or not 1 <= int(text) <= maximum:
        raise bad_request(f"'limit' must be an integer from 1 to {maximum}, got {text!r}.", param="limit")
    return int(text)


def page_order(query: Mapping[str, str]) -> str:
    """`order`: 'asc' or 'desc' (the default, newest first); else a 400 naming it."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"'order' must be 'asc' or 'desc', got {order!r}.", param="order")
    return order


def list_body(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page as OpenAI's list endpoints answer it: the objects, whether more follow, and the ids
    at its ends (the next page's `after` is `last_id`)."""
    return {
        "object": "list",
        "data": data,
        "has_more": has_more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
