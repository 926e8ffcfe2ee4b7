"""Images a request cannot use are refused before any is decoded: too many images before any is
read, and every image for a model without vision (after the cheap header checks, which give a
bad image its own 400), documents in the same message not extracted either."""

from __future__ import annotations

import pytest

from media import images
from testing.pdf import make_pdf
from tests.api.helpers import assert_error
from tests.api.test_files_http import upload
from tests.api.test_images_http import chat, data_url, png_bytes
from tests.media.pdf_fixtures import record_children


@pytest.fixture
def decoded(monkeypatch) -> list:
    """The images decoded (none should be)."""
    calls: list = []
    real = images.decode

    def recording(source, cfg):
        calls.append(source)
        return real(source, cfg)

    monkeypatch.setattr(images, "decode", recording)
    return calls


async def test_a_model_without_vision_refuses_images_before_decoding_any(make_client, monkeypatch, decoded):
    client = await make_client()
    children = record_children(monkeypatch)
    pdf = await upload(client, make_pdf(["Notes"]), filename="notes.pdf", content_type="application/pdf")
    content: list[dict] = [{"type": "file", "file": {"file_id": (await pdf.json())["id"]}}]
    for i in range(8):
        picture = png_bytes((256, 256), (i, 0, 0))
        resp = await upload(client, picture, filename=f"p{i}.png", content_type="image/png", purpose="vision")
        content.append({"type": "file", "file": {"file_id": (await resp.json())["id"]}})
    err = await assert_error(
        await chat(client, [{"role": "user", "content": content}]),
        400,
        code="image_input_not_supported",
        param="messages[0].content[1]",  # the first image, not the PDF before it
    )
    assert "'echo'" in err["message"]
    assert decoded == []
    assert children.procs == []  # the PDF was not read for a request refused anyway


async def test_too_many_images_are_refused_before_any_is_read(make_client, monkeypatch, decoded):
    client = await make_client("images.max_images_per_request=2")
    probed: list = []
    monkeypatch.setattr(images, "probe", lambda source, cfg: probed.append(source))
    three = [{"type": "image_url", "image_url": {"url": data_url(png_bytes())}}] * 3
    await assert_error(await chat(client, [{"role": "user", "content": three}]), 400, code="too_many_images")
    assert probed == [] and decoded == []
