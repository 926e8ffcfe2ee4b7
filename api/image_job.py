"""Images of a chat request handed to a vision model: which images fill the prompt's image slots.

The model's tokenizer (engine/native/image_prompt.py) has already put one run of image
tokens where each image sits; here the images still in the (possibly trimmed) context are
preprocessed for the model and attached to the generation request, so the engine can encode
them during prefill and key their tokens in the prefix cache by content.
"""

from __future__ import annotations

import dataclasses

from api.errors import bad_request
from api.job import Job
from media.images import DecodedImage
from media.workers import run_blocking


def prompter_of(model) -> object | None:
    """The model's ImagePrompter when it is a vision model, else None."""
    return getattr(model.tokenizer, "image_prompter", None)


async def place_images(job: Job, prompter, decoded: list[DecodedImage]) -> None:
    ids = job.gen.prompt_token_ids
    num_slots = prompter.num_slots(ids)
    if num_slots > len(decoded):
        raise bad_request(f"The prompt has {num_slots} image slots for {len(decoded)} images.", param="messages")
    # History trimming drops the oldest turns first, so the images left are the last ones.
    kept = decoded[len(decoded) - num_slots :]
    pixels = await run_blocking(lambda: [(d.content_hash, prompter.preprocess(d.image)) for d in kept])
    try:
        images = prompter.image_inputs(ids, pixels)
    except ValueError as exc:
        raise bad_request(f"The images do not match the prompt's image slots: {exc}.", param="messages") from None
    job.gen = dataclasses.replace(job.gen, images=images)
