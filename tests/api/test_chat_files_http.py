"""File parts in chat messages over HTTP (echo backend: the answer repeats the last user turn):
text and PDF files enter the prompt with a header, too-long files are refused or cut, the text is
cached per file, another organisation's file is a 404, conversations keep their attachments;
hostile PDFs (slow, bombs, encrypted, scanned) are 400s that name the problem while the server
keeps answering, and concurrent first reads of one file both succeed."""

from __future__ import annotations

import asyncio
import os
import threading

from api.files import BLOBS, TEXTS
from media import extraction
from testing.pdf import make_pdf
from tests.api.helpers import assert_error, state_of
from tests.api.test_files_http import other_org_headers, upload
from tests.api.test_images_http import data_url, png_bytes
from tests.media.pdf_fixtures import aes_encrypted_pdf, flate_bomb_pdf, image_only_pdf, record_children, slow_pdf


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
    assert "first version" in answer  # kept in memory: not even the cache file is read again
    client.server.app[TEXTS].forget(file_id)  # as when other files' texts pushed it out of memory
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


async def test_truncation_auto_cuts_a_new_file_when_the_stored_history_leaves_no_room(make_client):
    """The room for files was measured beside the whole stored history (which the answer drops from
    its oldest turn to fit): a history holding a long file left none, a 400 despite 'auto'."""
    client = await make_client()
    long_text = " ".join(f"word{i}" for i in range(1500)).encode()
    file_id = (await (await upload(client, long_text, filename="long.txt")).json())["id"]
    conv = await (await client.post("/v1/conversations", json={})).json()
    for turn in range(2):
        resp = await chat(client, file_message(file_id), truncation="auto", max_tokens=32, conversation_id=conv["id"])
        assert resp.status == 200, (turn, await resp.text())
        body = await resp.json()
        assert body["truncated_files"][0]["num_tokens_kept"] > 0 and body["usage"]["prompt_tokens"] + 32 <= 400
    assert body["history_messages_dropped"] == 2  # the first turn's file and answer made room


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


# -- damaged, hostile and slow files -------------------------------------------------------------
async def upload_pdf(client, data: bytes, filename: str = "doc.pdf") -> str:
    return (await (await upload(client, data, filename=filename, content_type="application/pdf")).json())["id"]


async def test_a_pdf_that_reads_too_slowly_is_refused_while_the_server_keeps_answering(make_client, monkeypatch):
    client = await make_client("files.max_extract_s=2", "files.max_concurrent_extractions=1")
    spawned = record_children(monkeypatch)
    slow_id = await upload_pdf(client, slow_pdf(), "slow.pdf")  # minutes of pypdf CPU in 5 kB
    slow = [asyncio.create_task(chat(client, file_message(slow_id))) for _ in range(4)]
    await spawned.started.wait()
    # Meanwhile uploads, text files and images are served: no thread is held by the PDF.
    note_id = (await (await upload(client, b"Meanwhile, all is well.", filename="note.txt")).json())["id"]
    note = await chat(client, file_message(note_id))
    assert note.status == 200, await note.text()
    image = [{"type": "image_url", "image_url": {"url": data_url(png_bytes())}}]
    await assert_error(await chat(client, [{"role": "user", "content": image}]), 400, code="image_input_not_supported")
    assert not any(task.done() for task in slow)
    for resp in await asyncio.gather(*slow):  # all four waited for the one reading
        err = await assert_error(resp, 400, code="unreadable_file", param="messages[0].content[1]")
        assert "slow.pdf" in err["message"] and "took too long to read" in err["message"]
        assert "2 s limit, files.max_extract_s" in err["message"]
    assert len(spawned.procs) == 1 and spawned.procs[0].returncode is not None  # read once, and killed
    await assert_error(await chat(client, file_message(slow_id)), 400, code="unreadable_file")
    assert len(spawned.procs) == 1  # the refusal is remembered: not read again


async def _reading_a_slow_pdf(make_client, monkeypatch):
    """(client, its PDF reader children, a chat request whose PDF is being read now)."""
    client = await make_client("files.max_extract_s=60")
    spawned = record_children(monkeypatch)
    slow_id = await upload_pdf(client, slow_pdf())
    request = asyncio.create_task(chat(client, file_message(slow_id)))
    await spawned.started.wait()
    return client, spawned, request


async def test_a_client_that_leaves_stops_its_pdf_reader(make_client, monkeypatch):
    _client, spawned, request = await _reading_a_slow_pdf(make_client, monkeypatch)
    request.cancel()  # the connection closes; the server cancels the handler, which kills the reader
    await asyncio.wait_for(spawned.procs[0].wait(), 10)  # unkilled, it would read for a minute


async def test_busy_pdf_readers_give_503_with_retry_after(make_client):
    # The wait for a slot is bounded by max_extract_s, and so is the reading after it: 3 s leaves a
    # loaded machine time to start the reader (0.2 s timed the second reading out under load).
    client = await make_client("files.max_extract_s=3", "files.max_concurrent_extractions=1")
    pdf_id = await upload_pdf(client, make_pdf(["Hello"]))
    slots = extraction._SLOTS.semaphore(1)
    await slots.acquire()  # another request's PDF holds the only reader
    try:
        err = await assert_error(await chat(client, file_message(pdf_id)), 503, code="server_overloaded")
    finally:
        slots.release()
    assert "busy reading other files" in err["message"]
    assert (await chat(client, file_message(pdf_id))).status == 200


async def test_bomb_encrypted_and_scanned_pdfs_are_400s_naming_the_problem(make_client):
    client = await make_client()
    cases = [
        (flate_bomb_pdf(), "reading the PDF reached a safety limit"),
        (aes_encrypted_pdf(), "the PDF is encrypted"),
        (image_only_pdf(2), "no text could be extracted from its 2 pages"),
    ]
    for data, problem in cases:
        file_id = await upload_pdf(client, data, "hostile.pdf")
        err = await assert_error(await chat(client, file_message(file_id)), 400, code="unreadable_file")
        assert f"The file hostile.pdf ({file_id}) cannot be read: {problem}" in err["message"]
    assert "does not do OCR" in err["message"]


async def test_a_utf16_text_file_with_a_bom_enters_the_prompt(make_client):
    client = await make_client()
    data = "Grüße aus Köln.".encode("utf-16")  # BOM first, NUL bytes throughout
    file_id = (await (await upload(client, data, filename="greeting.txt")).json())["id"]
    resp = await chat(client, file_message(file_id))
    assert resp.status == 200, await resp.text()
    assert (
        "--- File: greeting.txt (text/plain) ---\nGrüße aus Köln.\n"
        in (await resp.json())["choices"][0]["message"]["content"]
    )


async def test_two_requests_extracting_one_file_at_once_both_succeed(make_client, monkeypatch):
    """The first request's cache write pauses between its temp file and the rename while the
    second extracts and writes the same file's cache (a fixed temp name made the first fail)."""
    client = await make_client()
    file_id = (await (await upload(client, b"Shared notes.", filename="shared.txt")).json())["id"]
    real_replace = os.replace
    paused, resume = threading.Event(), threading.Event()

    def replace(src, dst):
        if os.fspath(dst).endswith(f"{file_id}.txt") and not paused.is_set():
            paused.set()
            resume.wait(10)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    first = asyncio.create_task(chat(client, file_message(file_id)))
    assert await asyncio.to_thread(paused.wait, 10)
    second = await chat(client, file_message(file_id))
    resume.set()
    assert second.status == 200, await second.text()
    assert (await first).status == 200, await (await first).text()


async def test_a_request_still_reading_its_pdf_at_shutdown_gets_a_503(make_client, monkeypatch):
    """The shutdown waits for it like a running answer, then answers it (it was dropped unanswered)."""
    from api.inflight import INFLIGHT

    client, spawned, request = await _reading_a_slow_pdf(make_client, monkeypatch)
    inflight = client.app[INFLIGHT]
    assert len(inflight) == 1  # the grace waits for it
    inflight.cut_all()  # the grace is over
    await assert_error(await request, 503, code="server_shutting_down")
    await asyncio.wait_for(spawned.procs[0].wait(), 10)  # its reader killed
