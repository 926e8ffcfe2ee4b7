"""File parts in chat messages over HTTP (echo backend: the answer repeats the last user turn):
text and PDF files enter the prompt with a header, too-long files are refused or cut, the text is
cached per file, another organisation's file is a 404, conversations keep their attachments."""

from __future__ import annotations

from api.files import BLOBS
from testing.pdf import make_pdf
from tests.api.helpers import assert_error, state_of
from tests.api.test_files_http import other_org_headers, upload


def file_message(file_id: str, text: str = "Summarize this:") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "file", "file": {"file_id": file_id}}]}
    ]


async def chat(client, messages, headers=None, **extra):
    body = {"model": "echo", "messages": messages, "max_tokens": 64, **extra}
    return await client.post("/v1/chat/completions", json=body, headers=headers or {})


async def test_text_file_enters_the_prompt_between_a_header_and_a_footer(make_client):
    client = await make_client()
    file_id = (await (await upload(client, b"The secret word is pineapple.", filename="notes.txt")).json())["id"]
    resp = await chat(client, file_message(file_id))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    answer = body["choices"][0]["message"]["content"]
    assert answer.startswith("Summarize this:\n\n--- File: notes.txt (text/plain) ---\nThe secret word is pineapple.")
    plain = await (await chat(client, [{"role": "user", "content": "Summarize this:"}])).json()
    assert body["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 5  # the file's tokens are billed


async def test_pdf_written_by_the_test_is_extracted_page_by_page(make_client):
    client = await make_client("tiers.enterprise.max_tokens=300", "tiers.enterprise.max_context_tokens=1000")
    pdf = make_pdf(["Quarterly revenue grew by nine percent.", "Costs fell in the second half."])
    file_id = (await (await upload(client, pdf, filename="report.pdf", content_type="application/pdf")).json())["id"]
    body = await (await chat(client, file_message(file_id), max_tokens=300)).json()
    answer = body["choices"][0]["message"]["content"]
    assert "--- File: report.pdf (PDF, 2 pages) ---" in answer
    assert "[Page 1]\nQuarterly revenue grew by nine percent." in answer
    assert "[Page 2]\nCosts fell in the second half." in answer


async def test_extracted_text_is_cached_per_file(make_client):
    client = await make_client()
    file_id = (await (await upload(client, b"first version")).json())["id"]
    await chat(client, file_message(file_id))
    cache = client.server.app[BLOBS].text_path(file_id)
    assert '"first version"' in cache.read_text()
    cache.write_text(cache.read_text().replace("first version", "from the cache"))
    answer = (await (await chat(client, file_message(file_id))).json())["choices"][0]["message"]["content"]
    assert "from the cache" in answer  # not extracted again


async def test_file_longer_than_the_context_is_refused_with_the_numbers(make_client):
    client = await make_client()  # the enterprise tier's context here: 400 tokens
    long_text = " ".join(f"word{i}" for i in range(1500)).encode()
    file_id = (await (await upload(client, long_text, filename="long.txt")).json())["id"]
    err = await assert_error(await chat(client, file_message(file_id)), 400, code="context_length_exceeded")
    assert "long.txt is" in err["message"] and "tokens" in err["message"] and "400" in err["message"]
    assert "'truncation': 'auto'" in err["message"] and "(model: echo)" in err["message"]


async def test_truncation_auto_cuts_the_file_and_says_what_was_left_out(make_client):
    client = await make_client()
    long_text = " ".join(f"word{i}" for i in range(1500)).encode()
    file_id = (await (await upload(client, long_text, filename="long.txt")).json())["id"]
    resp = await chat(client, file_message(file_id), truncation="auto", max_tokens=32)
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    (cut,) = body["truncated_files"]
    assert cut["file_id"] == file_id and cut["filename"] == "long.txt"
    assert 0 < cut["num_tokens_kept"] < cut["num_tokens"]
    assert body["usage"]["prompt_tokens"] + 32 <= 400
    await assert_error(await chat(client, file_message(file_id), truncation="sometimes"), 400, param="truncation")


async def test_unknown_or_foreign_file_is_404_and_binary_file_is_400(make_client):
    client = await make_client()
    file_id = (await (await upload(client, b"mine")).json())["id"]
    other = await other_org_headers(client)
    await assert_error(await chat(client, file_message(file_id), headers=other), 404, param="messages[0].content[1]")
    await assert_error(await chat(client, file_message("file-" + "0" * 24)), 404)
    binary = (
        await (
            await upload(client, b"\0\1\2\3" * 100, filename="x.bin", content_type="application/octet-stream")
        ).json()
    )["id"]
    await assert_error(await chat(client, file_message(binary)), 400, code="unreadable_file")
    bad = [{"role": "user", "content": [{"type": "file", "file": {"file_data": "aGk=", "filename": "a.txt"}}]}]
    await assert_error(await chat(client, bad), 400, param="messages[0].content[0].file.file_data")
    assistant = [{"role": "assistant", "content": [{"type": "file", "file": {"file_id": file_id}}]}]
    await assert_error(await chat(client, assistant), 400)


async def test_conversation_keeps_attachments_and_renders_them_again_next_turn(make_client):
    client = await make_client()
    file_id = (await (await upload(client, b"Remember: the meeting is at noon.")).json())["id"]
    conv = await (await client.post("/v1/conversations", json={})).json()
    first = await chat(client, file_message(file_id, "Read this."), conversation_id=conv["id"])
    assert first.status == 200, await first.text()
    stored = await (await client.get(f"/v1/conversations/{conv['id']}")).json()
    user = stored["messages"][0]
    assert user["content"] == "Read this."
    assert user["parts"] == [{"type": "text", "text": "Read this."}, {"type": "file", "file": {"file_id": file_id}}]
    second = await chat(client, [{"role": "user", "content": "When is it?"}], conversation_id=conv["id"])
    assert second.status == 200
    prompt_2 = (await second.json())["usage"]["prompt_tokens"]
    first_prompt = (await first.json())["usage"]["prompt_tokens"]
    assert prompt_2 > first_prompt  # the file's text is in the history again
    await client.delete(f"/v1/files/{file_id}")
    third = await chat(client, [{"role": "user", "content": "Still there?"}], conversation_id=conv["id"])
    assert third.status == 200  # a deleted file leaves a note in the history, not an error
    assert state_of(client).store is not None


async def test_responses_api_takes_input_file_and_input_image_parts(make_client):
    client = await make_client()
    file_id = (await (await upload(client, b"Pack an umbrella.", filename="tip.txt")).json())["id"]
    content = [{"type": "input_text", "text": "Read: "}, {"type": "input_file", "file_id": file_id}]
    resp = await client.post(
        "/v1/responses",
        json={"model": "echo", "input": [{"role": "user", "content": content}], "max_output_tokens": 64},
    )
    assert resp.status == 200, await resp.text()
    text = (await resp.json())["output"][0]["content"][0]["text"]
    assert text.startswith("Read: \n\n--- File: tip.txt (text/plain) ---\nPack an umbrella.")
    image = [{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]
    bad = await client.post("/v1/responses", json={"model": "echo", "input": [{"role": "user", "content": image}]})
    await assert_error(bad, 400, code="invalid_image")
    odd = [{"type": "input_audio", "data": "x"}]
    await assert_error(
        await client.post("/v1/responses", json={"model": "echo", "input": [{"role": "user", "content": odd}]}),
        400,
        param="input[0].content[0]",
    )


async def test_a_document_is_cut_at_max_document_chars_and_the_header_says_so(make_client):
    client = await make_client(
        "files.max_document_chars=20", "tiers.enterprise.max_tokens=300", "tiers.enterprise.max_context_tokens=1000"
    )
    file_id = (await (await upload(client, b"0123456789" * 10, filename="digits.txt")).json())["id"]
    body = await (await chat(client, file_message(file_id), max_tokens=300)).json()
    answer = body["choices"][0]["message"]["content"]
    assert "--- File: digits.txt (text/plain, the first 20 of 100 characters) ---\n01234567890123456789\n---" in answer
