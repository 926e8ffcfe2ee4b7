"""Files sent inline, not uploaded: chat's `file_data`, the Responses API's `input_file.file_data` and
Anthropic's `document` blocks, through the `openai` and `anthropic` SDKs (echo backend: the answer
repeats the last user turn as the model saw it). The text reaches the model as an uploaded file's
does, a stored turn renders it again on the next turn, nothing is kept besides the message that
holds it, and bad input is a 400 naming the field as the client spelled it."""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest

from api.files import BLOBS
from testing.pdf import make_pdf
from tests.api.helpers import assert_error, state_of
from tests.api.test_chat_files_http import chat, file_message
from tests.api.test_files_http import other_org_headers, upload
from tests.api.test_images_http import png_bytes
from tests.media.pdf_fixtures import image_only_pdf, record_children, slow_pdf

PDF = make_pdf(["Quarterly revenue grew by nine percent.", "Costs fell in the second half."])
NOTES = b"The secret word is pineapple."
ROOMY = ("tiers.enterprise.max_tokens=300", "tiers.enterprise.max_context_tokens=1000")  # whole files echoed


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def inline_message(data: bytes, media_type: str, filename: str | None = "notes.txt", text: str = "Read:") -> list:
    file = {"file_data": data_url(data, media_type), **({"filename": filename} if filename else {})}
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "file", "file": file}]}]


async def _key(client) -> str:
    return (await other_org_headers(client))["Authorization"].removeprefix("Bearer ")


def _left_on_disk(client) -> list[str]:
    root = client.server.app[BLOBS].root
    return sorted(p.name for p in [*root.iterdir(), *(root / ".partial").iterdir()] if p.is_file())


def _last_prompt(client) -> list:
    return list(state_of(client).models["echo"].backend.requests[-1].chat.messages)


async def test_the_openai_sdk_sends_a_pdf_and_a_text_file_inline_read_as_uploads_are(make_client):
    client = await make_client(*ROOMY)
    key = await _key(client)
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0) as sdk:
        answers = []
        for data, media_type, name in ((PDF, "application/pdf", "report.pdf"), (NOTES, "text/plain", "notes.txt")):
            sent = await sdk.chat.completions.create(
                model="echo", messages=inline_message(data, media_type, name), max_tokens=300
            )
            answers.append(sent.choices[0].message.content)
    assert "Read:\n\n--- File: report.pdf (PDF, 2 pages) ---\n[Page 1]\nQuarterly revenue grew" in answers[0]
    assert "[Page 2]\nCosts fell in the second half." in answers[0]
    assert answers[1].startswith("Read:\n\n--- File: notes.txt (text/plain) ---\nThe secret word is pineapple.")
    # Exactly what the same bytes uploaded and sent by file_id give:
    auth = {"Authorization": f"Bearer {key}"}
    pdf_id = (await (await upload(client, PDF, filename="report.pdf", headers=auth)).json())["id"]
    uploaded = await (await chat(client, file_message(pdf_id, "Read:"), headers=auth, max_tokens=300)).json()
    assert uploaded["choices"][0]["message"]["content"] == answers[0]
    # Nothing was kept: one file listed (the upload), no scratch file left beside the uploads.
    assert [f["id"] for f in (await (await client.get("/v1/files", headers=auth)).json())["data"]] == [pdf_id]
    assert _left_on_disk(client) == [pdf_id, f"{pdf_id}.txt"]


async def test_an_unnamed_inline_file_is_called_document_and_its_bytes_decide_its_type(make_client):
    client = await make_client(*ROOMY)
    resp = await chat(client, inline_message(PDF, "application/octet-stream", filename=None), max_tokens=300)
    assert resp.status == 200, await resp.text()
    answer = (await resp.json())["choices"][0]["message"]["content"]
    assert answer.startswith("Read:\n\n--- File: document (PDF, 2 pages) ---\n[Page 1]\nQuarterly revenue grew")


@pytest.mark.parametrize("max_text_memory_chars", [16_000_000, 0])
async def test_a_stored_turn_with_an_inline_file_renders_it_again_on_the_next_turn(
    make_client, monkeypatch, max_text_memory_chars
):
    client = await make_client(f"files.max_text_memory_chars={max_text_memory_chars}", *ROOMY)
    spawned = record_children(monkeypatch)
    conv = await (await client.post("/v1/conversations", json={})).json()
    message = inline_message(PDF, "application/pdf", "report.pdf")
    first = await chat(client, message, conversation_id=conv["id"])
    assert first.status == 200, await first.text()
    first_prompt = _last_prompt(client)
    stored = await (await client.get(f"/v1/conversations/{conv['id']}")).json()
    assert stored["messages"][0]["parts"] == message[0]["content"]  # kept in the message, as sent
    second = await chat(client, [{"role": "user", "content": "How much did revenue grow?"}], conversation_id=conv["id"])
    assert second.status == 200, await second.text()
    history = _last_prompt(client)
    assert history[0] == first_prompt[0]  # rendered as on its own turn (the prefix cache hits)
    assert "[Page 1]\nQuarterly revenue grew by nine percent." in history[0]["content"]
    # Read once while its text is in memory; with no memory, read again from the stored message.
    assert len(spawned.procs) == (1 if max_text_memory_chars else 2)
    assert _left_on_disk(client) == []


async def test_responses_input_file_with_file_data_and_its_next_turn(make_client):
    client = await make_client(*ROOMY)
    async with openai.AsyncOpenAI(
        base_url=str(client.make_url("/v1")), api_key=await _key(client), max_retries=0
    ) as sdk:
        file = {"type": "input_file", "filename": "notes.txt", "file_data": data_url(NOTES, "text/plain")}
        content = [{"type": "input_text", "text": "Read:"}, file]
        first = await sdk.responses.create(
            model="echo", input=[{"role": "user", "content": content}], max_output_tokens=300
        )
        assert first.output_text.startswith("Read:\n\n--- File: notes.txt (text/plain) ---\nThe secret word is")
        second = await sdk.responses.create(model="echo", input="And the word?", previous_response_id=first.id)
        assert second.output_text == "And the word?"
        assert "The secret word is pineapple." in _last_prompt(client)[0]["content"]  # the history's file
        items = await sdk.responses.input_items.list(first.id)
        assert items.data[0].content[1].file_data == file["file_data"]  # type: ignore[union-attr]


async def test_anthropic_document_blocks_base64_pdf_and_text_source(make_client):
    client = await make_client(*ROOMY)
    async with anthropic.AsyncAnthropic(
        base_url=str(client.make_url("")), api_key=await _key(client), max_retries=0
    ) as sdk:
        pdf = {"type": "base64", "media_type": "application/pdf", "data": base64.b64encode(PDF).decode()}
        blocks = [
            {"type": "document", "source": pdf, "title": "report.pdf", "context": "Our 2025 report."},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Notes: all good."}},
            {"type": "text", "text": "Summarize both."},
        ]
        msg = await sdk.messages.create(model="echo", max_tokens=300, messages=[{"role": "user", "content": blocks}])
        answer = msg.content[0].text  # type: ignore[union-attr]
        assert answer.startswith("--- File: report.pdf (PDF, 2 pages) ---\n[Page 1]\nQuarterly revenue grew")
        assert "--- End of file: report.pdf ---\n\nDocument context: Our 2025 report." in answer
        assert answer.endswith("(text/plain) ---\nNotes: all good.\n--- End of file: document ---\n\nSummarize both.")
        # Refused before anything is generated, naming the block's field:
        bad = [
            ({"type": "base64", "media_type": "application/pdf", "data": "not base64!"}, {}, "source"),
            ({"type": "url", "url": "https://example.com/a.pdf"}, {}, "source"),
            ({"type": "base64", "media_type": "application/pdf", "data": "JVBERg=="}, {}, "source"),
            (pdf, {"citations": {"enabled": True}}, "citations"),
        ]
        for source, extra, field in bad:
            ask = [{"type": "text", "text": "Hi."}, {"type": "document", "source": source, **extra}]
            with pytest.raises(anthropic.BadRequestError) as caught:
                await sdk.messages.create(model="echo", max_tokens=8, messages=[{"role": "user", "content": ask}])
            assert f"(param: messages[0].content[1].{field})" in str(caught.value)
    assert len(state_of(client).models["echo"].backend.requests) == 1


async def test_anthropic_document_blocks_with_an_uploaded_file_and_a_content_source(make_client):
    client = await make_client(*ROOMY)
    key = await _key(client)
    file_id = (await (await upload(client, NOTES, headers={"Authorization": f"Bearer {key}"})).json())["id"]
    blocks = [
        {"type": "document", "source": {"type": "file", "file_id": file_id}},
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "Line one."}]}},
    ]
    async with anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key=key, max_retries=0) as sdk:
        msg = await sdk.messages.create(model="echo", max_tokens=300, messages=[{"role": "user", "content": blocks}])
        answer = msg.content[0].text  # type: ignore[union-attr]
        assert answer.startswith("--- File: notes.txt (text/plain) ---\nThe secret word is pineapple.\n---")
        assert answer.endswith("--- File: document (text/plain) ---\nLine one.\n--- End of file: document ---")
        unknown = [{"type": "document", "source": {"type": "file", "file_id": "file-" + "0" * 24}}]
        with pytest.raises(anthropic.NotFoundError) as caught:
            await sdk.messages.create(model="echo", max_tokens=8, messages=[{"role": "user", "content": unknown}])
        assert "(param: messages[0].content[0].source)" in str(caught.value)


async def test_bad_inline_files_are_400s_naming_the_field_before_any_stream(make_client):
    client = await make_client("files.max_file_bytes=4000")
    where = "messages[0].content[1].file.file_data"
    cases = [
        (inline_message(NOTES, "text/plain")[0]["content"][1]["file"] | {"file_data": "aGVsbG8="}, "invalid_file_data"),
        ({"file_data": "data:text/plain;base64,not base64!"}, "invalid_file_data"),
        ({"file_data": data_url(b"x" * 4001, "text/plain")}, "file_too_large"),
        ({"file_data": data_url(png_bytes(), "image/png")}, "unsupported_file_type"),
        ({"file_data": data_url(b"PK\3\4\0\0\0\0" * 8, "application/zip")}, "unreadable_file"),
        ({"file_data": data_url(image_only_pdf(1), "application/pdf")}, "unreadable_file"),
    ]
    for file, code in cases:
        message = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "file", "file": file}]}]
        await assert_error(await chat(client, message, stream=True), 400, code=code, param=where)
    both = {"file_id": "file-" + "0" * 24, "file_data": data_url(NOTES, "text/plain")}
    message = [{"role": "user", "content": [{"type": "file", "file": both}]}]
    await assert_error(await chat(client, message), 400, param="messages[0].content[0].file.file_id")
    assert state_of(client).models["echo"].backend.requests == []
    assert _left_on_disk(client) == []


async def test_an_inline_pdf_that_reads_too_slowly_is_a_400_naming_it(make_client):
    client = await make_client("server.max_body_bytes=200000", "files.max_extract_s=1")
    resp = await chat(client, inline_message(slow_pdf(), "application/pdf", "slow.pdf"))
    err = await assert_error(resp, 400, code="unreadable_file", param="messages[0].content[1].file.file_data")
    assert "The file slow.pdf cannot be read: the PDF took too long to read" in err["message"]
    assert _left_on_disk(client) == []


async def test_responses_errors_name_the_input_as_sent_after_instructions(make_client):
    client = await make_client()

    async def respond(content):
        body = {"model": "echo", "instructions": "Be brief.", "input": [{"role": "user", "content": content}]}
        return await client.post("/v1/responses", json=body)

    bad = [{"type": "input_text", "text": "Hi"}, {"type": "input_file", "file_data": "data:text/plain;base64,!!"}]
    await assert_error(await respond(bad), 400, code="invalid_file_data", param="input[0].content[1].file_data")
    shape = [{"type": "input_file", "file_data": "hello"}]
    await assert_error(await respond(shape), 400, code="invalid_file_data", param="input[0].content[0].file_data")
    url = [{"type": "input_file", "file_url": "https://example.com/a.pdf"}]
    await assert_error(await respond(url), 400, code="file_url_not_allowed", param="input[0].content[0].file_url")
    unknown = [{"type": "input_file", "file_id": "file-" + "0" * 24}]
    await assert_error(await respond(unknown), 404, param="input[0].content[0]")  # was input[1]: the instructions


async def test_inline_files_count_toward_max_files_per_request_with_uploaded_ones(make_client):
    client = await make_client("files.max_files_per_request=1")
    file_id = (await (await upload(client, NOTES)).json())["id"]
    content = [
        {"type": "file", "file": {"file_id": file_id}},
        {"type": "file", "file": {"file_data": data_url(NOTES, "text/plain")}},
    ]
    await assert_error(await chat(client, [{"role": "user", "content": content}]), 400, code="too_many_files")
    assert (await chat(client, inline_message(NOTES, "text/plain"))).status == 200


async def test_input_tokens_fits_a_long_file_as_the_response_does_per_truncation(make_client):
    """The count counted a file far past the context whole: the response refuses it (truncation
    'disabled', the default) or cuts it ('auto'); the count gives the same 400, or the cut count."""
    client = await make_client()  # the enterprise tier's context here: 400 tokens
    key = await _key(client)
    long_text = " ".join(f"word{i}" for i in range(1500)).encode()
    file = {"type": "input_file", "filename": "long.txt", "file_data": data_url(long_text, "text/plain")}
    ask = {"model": "echo", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Read:"}, file]}]}
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0) as sdk:
        refusals = []
        for call in (sdk.responses.input_tokens.count, sdk.responses.create):
            with pytest.raises(openai.BadRequestError) as refused:
                await call(**ask)  # type: ignore[operator]
            refusals.append(refused.value.body)
        assert refusals[0] == refusals[1] and refusals[0]["code"] == "context_length_exceeded"  # type: ignore[index]
        counted = await sdk.responses.input_tokens.count(**ask, truncation="auto")  # type: ignore[arg-type]
        answered = await sdk.responses.create(**ask, truncation="auto")  # type: ignore[arg-type]
        assert counted.input_tokens == answered.usage.input_tokens < 400  # type: ignore[union-attr]


async def test_token_counts_read_files_as_the_answer_does_and_refuse_what_it_refuses(make_client):
    """Both counters counted a message's text parts only: a file (inline, uploaded, or in the
    history of previous_response_id) added nothing, and one the answer refuses counted as well."""
    client = await make_client(*ROOMY)
    key = await _key(client)
    pdf = {"type": "input_file", "filename": "report.pdf", "file_data": data_url(PDF, "application/pdf")}
    ask = {"model": "echo", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Read:"}, pdf]}]}
    async with openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0) as sdk:
        counted = await sdk.responses.input_tokens.count(**ask)
        answered = await sdk.responses.create(**ask, max_output_tokens=4)
        assert counted.input_tokens == answered.usage.input_tokens  # type: ignore[union-attr]
        follow = {"model": "echo", "input": "And?", "previous_response_id": answered.id}
        counted = await sdk.responses.input_tokens.count(**follow)
        assert counted.input_tokens == (await sdk.responses.create(**follow)).usage.input_tokens  # type: ignore[union-attr]
        bad = {"type": "input_file", "file_data": "data:text/plain;base64,!!"}
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.responses.input_tokens.count(model="echo", input=[{"role": "user", "content": [bad]}])
        assert caught.value.body["param"] == "input[0].content[0].file_data"  # type: ignore[index]
    file_id = (await (await upload(client, NOTES, headers={"Authorization": f"Bearer {key}"})).json())["id"]
    blocks = [
        {"type": "document", "source": {"type": "file", "file_id": file_id}},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Notes: all good."}},
        {"type": "text", "text": "Summarize both."},
    ]
    messages = [{"role": "user", "content": blocks}]
    async with anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key=key, max_retries=0) as sdk:
        counted_msg = await sdk.messages.count_tokens(model="echo", messages=messages)  # type: ignore[arg-type]
        msg = await sdk.messages.create(model="echo", max_tokens=4, messages=messages)  # type: ignore[arg-type]
        assert counted_msg.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
        unknown = [{"type": "document", "source": {"type": "file", "file_id": "file-" + "0" * 24}}]
        with pytest.raises(anthropic.NotFoundError):
            await sdk.messages.count_tokens(model="echo", messages=[{"role": "user", "content": unknown}])
    assert all(name.startswith(file_id) for name in _left_on_disk(client))  # the upload and its text; no scratch
