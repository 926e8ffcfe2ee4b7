"""The import's document checks on their own (api/import_document.py): the order of conversations
of one second, times never after now, what the import adds to the storage count, the files the
parts name, and the fields an import does not keep."""

from __future__ import annotations

import orjson
import pytest

from api.errors import ApiError
from api.import_document import ImportLimits, parse_document

LIMITS = ImportLimits(max_message_chars=1000, max_conversations=10, max_messages=100)
SECOND = 1_700_000_000


def conversation(**fields) -> dict:
    return {"object": "conversation", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_conversations_of_one_second_keep_the_files_order_even_in_the_second_it_is_imported():
    doc = {"object": "list", "data": [conversation(created_at=SECOND, updated_at=SECOND) for _ in range(4)]}
    for now in (SECOND + 0.3, SECOND + 5.0):
        parsed = parse_document(doc, LIMITS, now).conversations
        created = [c.created_at for c in parsed]
        assert created == sorted(created, reverse=True) and len(set(created)) == 4  # the first the latest
        assert all(SECOND <= t <= now and int(t) == SECOND for t in created)
        assert [c.updated_at for c in parsed] == created


def test_times_after_now_are_now_and_missing_ones_come_from_the_conversation_or_now():
    now = SECOND + 0.5
    future = conversation(created_at=SECOND + 100, messages=[{"role": "user", "content": "x", "created_at": 9e18}])
    parsed = parse_document({"object": "list", "data": [future, conversation()]}, LIMITS, now).conversations
    assert (parsed[0].created_at, parsed[0].updated_at, parsed[0].messages[0].created_at) == (now, now, now)
    assert (parsed[1].created_at, parsed[1].messages[0].created_at) == (now, now)
    old = conversation(created_at=SECOND - 50, messages=[{"role": "user", "content": "x"}])
    (parsed_old,) = parse_document(old, LIMITS, now).conversations
    assert parsed_old.messages[0].created_at == SECOND - 50  # the conversation's own time
    assert int(parsed_old.updated_at) == SECOND - 50  # no updated_at: its latest message's


def test_the_count_against_the_storage_cap_is_text_and_parts_as_stored_and_file_ids_are_listed_once():
    parts = [
        {"type": "text", "text": "see"},
        {"type": "file", "file": {"file_id": "file-a"}},
        {"type": "image_url", "image_url": {"file_id": "file-b"}},
        {"type": "file", "file": {"file_id": "file-a"}},
    ]
    doc = conversation(
        messages=[{"role": "user", "content": "see", "parts": parts}, {"role": "assistant", "content": "ok"}]
    )
    parsed = parse_document(doc, LIMITS, SECOND)
    stored = parsed.conversations[0].messages[0].parts_json
    assert stored is not None and orjson.loads(stored)[2] == {
        "type": "image_url",
        "image_url": {"file_id": "file-b", "detail": "auto"},
    }
    assert parsed.num_chars == len("see") + len(stored) + len("ok")
    assert parsed.file_ids == ("file-a", "file-b")
    assert (parsed.num_messages, parsed.source_ids) == (2, (None,))


def test_only_answers_keep_a_model_tokens_and_finish_reason_and_the_files_ids_are_never_used():
    messages = [
        {"id": "msg_old1", "role": "user", "content": "q", "model": "echo", "tokens": 3, "finish_reason": "stop"},
        {
            "id": "msg_old2",
            "role": "assistant",
            "content": "a",
            "model": "echo",
            "tokens": 3,
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 1},
            "feedback": {"rating": 1},
        },
    ]
    parsed = parse_document(conversation(id="conv_old", messages=messages), LIMITS, SECOND)
    user, answer = parsed.conversations[0].messages
    assert (user.model, user.tokens, user.finish_reason) == (None, None, None)
    assert (answer.model, answer.tokens, answer.finish_reason) == ("echo", 3, "stop")
    assert {user.id, answer.id}.isdisjoint({"msg_old1", "msg_old2"}) and user.id.startswith("msg_")
    assert parsed.source_ids == ("conv_old",)


@pytest.mark.parametrize("title", ["", "   ", None])
def test_a_blank_or_missing_title_is_none(title):
    assert parse_document(conversation(title=title), LIMITS, SECOND).conversations[0].title is None


def test_a_bad_field_is_a_400_naming_it():
    with pytest.raises(ApiError) as caught:
        parse_document({"object": "list", "data": [conversation(), conversation(metadata=[])]}, LIMITS, SECOND)
    assert (caught.value.status, caught.value.param) == (400, "data[1].metadata")
