"""Images of a chat request handed to a vision model: which images fill the prompt's image slots.

The model's tokenizer (engine/native/image_prompt.py) has already put one run of image
tokens where each image sits; here the images still in the (possibly trimmed) context are
decoded and preprocessed for the model, or found already prepared in its cache
(`PreparedImages`, by their bytes' sha256: a conversation's earlier images come back every
turn), and attached to the generation request, so the engine can encode them during prefill
and key their tokens in the prefix cache by content. Images trimmed out of the context are
never decoded.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from api.errors import ApiError, bad_request
from api.job import Job
from media import images
from media.workers import run_blocking
from settings import ImagesConfig

ImageSource = bytes | Path  # a data: URL's or fetched image's bytes, or an uploaded image's path


HISTORY = "history"  # the `where` of a stored history's parts (api/attachments.history_message)


@dataclasses.dataclass(frozen=True, slots=True)
class ReadImage:
    """An image of the request read and checked from its headers (media/images.probe), not yet decoded."""

    source: ImageSource
    digest: str  # sha256 of its encoded bytes (media/images.digest_of)
    where: str  # the part it came from, for a 400 naming it
    key: str  # its file id, else its URL (api/attachment_parts.image_key)


class UnreadableHistoryImage(Exception):
    """An image of a stored history that no longer decodes (imported with damaged pixels, or stored
    before a limit was lowered): its turn renders it as "[image]" instead (api/attachments.py)."""

    def __init__(self, key: str, error: ApiError) -> None:
        super().__init__(error.message)
        self.key = key
        self.error = error


def prompter_of(model) -> object | None:
    """The model's ImagePrompter when it is a vision model, else None."""
    return getattr(model.tokenizer, "image_prompter", None)


@contextlib.contextmanager
def image_errors(where: str) -> Iterator[None]:
    """An image refused (media/images.ImageRejected) as a 400 naming the part it came from."""
    try:
        yield
    except images.ImageRejected as exc:
        raise bad_request(f"{exc.message} ('{where}')", param=where, code=exc.code) from None


async def place_images(job: Job, prompter, read: list[ReadImage], cfg: ImagesConfig) -> None:
    ids = job.gen.prompt_token_ids
    num_slots = prompter.num_slots(ids)
    if num_slots > len(read):
        raise bad_request(f"The prompt has {num_slots} image slots for {len(read)} images.", param="messages")
    # History trimming drops the oldest turns first, so the images left are the last ones.
    kept = read[len(read) - num_slots :]
    prepared = {image.digest: await _prepared(prompter, image, cfg) for image in {i.digest: i for i in kept}.values()}
    pixels = [prepared[image.digest] for image in kept]  # an image named twice: decoded once
    try:
        image_inputs = prompter.image_inputs(ids, pixels)
    except ValueError as exc:
        raise bad_request(f"The images do not match the prompt's image slots: {exc}.", param="messages") from None
    job.gen = dataclasses.replace(job.gen, images=image_inputs)


async def _prepared(prompter, image: ReadImage, cfg: ImagesConfig) -> tuple[str, np.ndarray]:
    """(content hash, pixels) of `image` for the model: from its cache, else decoded and preprocessed."""
    found = prompter.prepared.get(image.digest)
    if found is not None:
        return found
    try:
        with image_errors(image.where):
            decoded = await images.decode_bounded(image.source, cfg)
    except ApiError as exc:
        if image.where.startswith(HISTORY):
            raise UnreadableHistoryImage(image.key, exc) from None
        raise
    prepared = (decoded.content_hash, await run_blocking(prompter.preprocess, decoded.image))
    prompter.prepared.put(image.digest, prepared, cfg.prepared_cache_mb << 20)
    return prepared
