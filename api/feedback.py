"""Feedback on answers (our extension; OpenAI's API has no shape for it):

    POST /v1/conversations/{conversation_id}/messages/{message_id}/feedback
    {"rating": 1 | -1 | null, "comment": "text" | null, "regenerated": true, "edited_prompt": "text"}

Every field is optional; those sent are set (null clears a rating or comment), the others
are kept. `regenerated` and `edited_prompt` record that the user asked for another answer or
rewrote the prompt (the web UI sends them before it truncates the conversation). The reply,
and each answer's "feedback" in GET /v1/conversations/{id}, is the object `feedback_obj`
renders. `python server.py feedback export` writes every row as JSON lines.
"""

from __future__ import annotations

from aiohttp import web

from api.chat import read_json
from api.errors import bad_request, not_found
from api.state import PRINCIPAL, STATE
from store.feedback import Feedback, FeedbackChange
from store.types import NotFound

MAX_COMMENT_CHARS = 2000
MAX_EDITED_PROMPT_CHARS = 100_000
_FIELDS = ("rating", "comment", "regenerated", "edited_prompt")


def feedback_obj(f: Feedback) -> dict:
    return {
        "object": "conversation.message.feedback",
        "message_id": f.message_id,
        "rating": f.rating,
        "comment": f.comment,
        "regenerated": f.regenerated,
        "edited_prompt": f.edited_prompt,
        "updated_at": f.updated_at,
    }


def parse_change(body: object) -> FeedbackChange:
    """The validated request body; each error names the field and the value received."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise bad_request(f"Unknown field '{unknown[0]}'; expected some of {list(_FIELDS)}.", param=unknown[0])
    if not body:
        raise bad_request(f"Send at least one of {list(_FIELDS)}.")
    rating = body.get("rating")
    if rating is not None and (type(rating) is not int or rating not in (1, -1)):
        raise bad_request(f"'rating' must be 1 (thumbs up), -1 (thumbs down) or null, got {rating!r}.", param="rating")
    comment = _text(body, "comment", MAX_COMMENT_CHARS)
    regenerated = body.get("regenerated", False)
    if regenerated is not True and regenerated is not False:
        raise bad_request(f"'regenerated' must be true or false, got {regenerated!r}.", param="regenerated")
    return FeedbackChange(
        rating=rating,
        clear_rating="rating" in body and rating is None,
        comment=comment,
        clear_comment="comment" in body and comment is None,
        regenerated=regenerated,
        edited_prompt=_text(body, "edited_prompt", MAX_EDITED_PROMPT_CHARS),
    )


def _text(body: dict, name: str, max_chars: int) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string or null, got {type(value).__name__}.", param=name)
    if len(value) > max_chars:
        raise bad_request(f"'{name}' may have at most {max_chars} characters, got {len(value)}.", param=name)
    return value


async def set_feedback(request: web.Request) -> web.Response:
    change = parse_change(await read_json(request))
    cid, mid = request.match_info["conversation_id"], request.match_info["message_id"]
    try:
        saved = await request.app[STATE].store.set_feedback(request[PRINCIPAL].org.id, cid, mid, change)
    except NotFound as exc:
        raise not_found(f"{str(exc)[:1].upper()}{str(exc)[1:]}.", param="message_id") from None
    return web.json_response(feedback_obj(saved))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/conversations/{conversation_id}/messages/{message_id}/feedback", set_feedback)
