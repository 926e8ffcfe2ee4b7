"""LLaVA in the native engine: preprocessing equals transformers' CLIP image processor, greedy
output equals transformers' LlavaForConditionalGeneration with one and two images (batched),
and the prefix cache keys image tokens by the image's content."""

from __future__ import annotations

import copy
import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

from engine.native.image_processor import ClipImageProcessor
from engine.native.image_prompt import PreparedImages
from engine.native.llm_engine import LLMEngine
from engine.native.loader import load_model_args
from engine.types import GenerationRequest, ImageInput, SamplingParams
from native_harness import ON_DEVICE, check_invariants
from settings import EngineConfig
from testing.tiny_llava import IMAGE_TOKEN, build_tiny_llava

BLOCK_SIZE = 8
NUM_IMAGE_TOKENS = 16  # (32 / 8) ** 2 patches, CLS dropped


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava")


@pytest.fixture(scope="module")
def reference(llava_dir):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(llava_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(llava_dir)


def picture(seed: int, size=(45, 60)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype(np.uint8))


def prompt_with_images(tokenizer, llava_dir, texts: list[str], images: list[Image.Image]) -> tuple[list[int], tuple]:
    """text0 <image> text1 <image> ... with each <image> expanded to its tokens, and the ImageInputs."""
    processor = ClipImageProcessor.from_dir(llava_dir)
    image_id = tokenizer.token_to_id(IMAGE_TOKEN)
    ids: list[int] = []
    inputs = []
    for i, text in enumerate(texts):
        ids += tokenizer.encode(text)
        if i < len(images):
            pixels = processor(images[i])
            digest = hashlib.sha256(pixels.tobytes()).hexdigest()
            inputs.append(ImageInput(len(ids), NUM_IMAGE_TOKENS, digest, pixels))
            ids += [image_id] * NUM_IMAGE_TOKENS
    return ids, tuple(inputs)


def hf_greedy(reference, prompt: list[int], images: tuple, max_tokens: int) -> list[int]:
    config = copy.deepcopy(reference.generation_config)
    config.max_new_tokens, config.do_sample, config.eos_token_id = max_tokens, False, 10**9
    pixel_values = torch.from_numpy(np.stack([img.pixel_values for img in images]))
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([prompt]),
            pixel_values=pixel_values,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    return out[0, len(prompt) :].tolist()


def make_engine(llava_dir, *, native_kernels: bool, max_num_batched_tokens: int = 24) -> LLMEngine:
    args = load_model_args(llava_dir)
    block_bytes = args.num_layers * 2 * BLOCK_SIZE * args.num_kv_heads * args.head_dim * 4
    config = EngineConfig(
        **ON_DEVICE,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=64 * block_bytes,
        native_kernels=native_kernels,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=4,
    )
    engine = LLMEngine.from_model_dir(llava_dir, config, eos_token_ids=(10**9 - 1,))
    engine.runner.kv_pool.fill_(float("nan"))  # a slot read before it is written would poison the output
    return engine


def run(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], int]]:
    """Generate all requests together; {request_id: (tokens, cached prompt tokens)}."""
    out = {r.request_id: ([], 0) for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] = (out[o.request_id][0] + list(o.new_token_ids), o.num_cached_tokens)
        check_invariants(engine.block_manager, engine.scheduler.running)
    return out


def request(request_id: str, prompt: list[int], images: tuple, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(
        request_id, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), images=images
    )


def test_preprocessing_equals_transformers_clip_image_processor(llava_dir):
    from transformers import CLIPImageProcessorPil

    hf = CLIPImageProcessorPil.from_pretrained(llava_dir)
    ours = ClipImageProcessor.from_dir(llava_dir)
    for size in [(45, 60), (60, 45), (32, 32), (200, 37), (20, 90)]:
        image = picture(sum(size), size)
        expected = hf(images=image, return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(ours(image), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("native_kernels", [False, True])
def test_greedy_equals_transformers_with_one_and_two_images_batched(llava_dir, reference, tokenizer, native_kernels):
    engine = make_engine(llava_dir, native_kernels=native_kernels)
    one_ids, one_images = prompt_with_images(tokenizer, llava_dir, ["Look at this: ", " What is it?"], [picture(1)])
    two_ids, two_images = prompt_with_images(
        tokenizer, llava_dir, ["First ", " then ", " compare them."], [picture(2), picture(3, (80, 40))]
    )
    got = run(engine, [request("one", one_ids, one_images), request("two", two_ids, two_images)])
    assert got["one"][0] == hf_greedy(reference, one_ids, one_images, 8)
    assert got["two"][0] == hf_greedy(reference, two_ids, two_images, 8)
    assert got["one"][0] != hf_greedy(
        reference,
        one_ids,
        prompt_with_images(tokenizer, llava_dir, ["Look at this: ", " What is it?"], [picture(9)])[1],
        8,
    )  # the image matters


def test_same_image_next_turn_hits_the_prefix_cache_and_a_different_image_does_not(llava_dir, reference, tokenizer):
    engine = make_engine(llava_dir, native_kernels=True)
    texts = ["A photo: ", " Describe it in a few words please."]
    first_ids, first_images = prompt_with_images(tokenizer, llava_dir, texts, [picture(4)])
    first = run(engine, [request("t1", first_ids, first_images)])["t1"][0]
    follow = tokenizer.encode(" And the colors?")
    second_ids = first_ids + first + follow
    second = run(engine, [request("t2", second_ids, first_images)])["t2"]
    image_end = first_images[0].offset + NUM_IMAGE_TOKENS
    assert second[1] >= image_end  # blocks holding the image's tokens were reused
    assert second[0] == hf_greedy(reference, second_ids, first_images, 8)

    other_ids, other_images = prompt_with_images(tokenizer, llava_dir, texts, [picture(5)])  # same size
    assert other_ids == first_ids  # the token ids alone are identical
    other = run(engine, [request("t3", other_ids + first + follow, other_images)])["t3"]
    assert other[1] <= first_images[0].offset  # nothing from the image onwards was shared
    assert other[0] == hf_greedy(reference, other_ids + first + follow, other_images, 8)


def test_prepared_images_keep_the_most_recently_used_within_their_byte_cap():
    prepared = PreparedImages()
    pixels = {name: np.zeros(1000, dtype=np.float32) for name in "abcd"}  # 4,000 bytes each
    for name in "abc":
        prepared.put(name, (f"hash-{name}", pixels[name]), max_bytes=10_000)
    assert len(prepared) == 2 and prepared.get("a") is None  # the oldest went past 10,000 bytes
    assert prepared.get("b") == ("hash-b", pixels["b"]) and prepared.num_hits == 1
    prepared.put("d", ("hash-d", pixels["d"]), max_bytes=10_000)
    assert prepared.get("c") is None and prepared.get("b") is not None  # b was used since c came
    assert prepared.num_bytes == 8000
    prepared.put("e", ("hash-e", np.zeros(5000, dtype=np.float32)), max_bytes=10_000)  # larger than the cap
    assert prepared.get("e") is None and prepared.num_bytes == 8000
    prepared.put("f", ("hash-f", pixels["a"]), max_bytes=0)  # a cap of 0 keeps nothing new
    assert prepared.get("f") is None
