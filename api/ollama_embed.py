"""POST /api/embed and /api/embeddings: Ollama's embeddings API over the embeddings path of
POST /v1/embeddings (api/embeddings.py: the bundled all-MiniLM-L6-v2, limits, budget, ledger).

/api/embed takes `input` (a string or an array of strings) and answers `embeddings` (one
384-dimension vector each, L2-normalised as Ollama's are) with `prompt_eval_count` (the tokens
billed) and `total_duration`; `truncate: false` makes an input past 256 tokens a 400 (true, the
default, cuts it unless embeddings.truncate is false). The older /api/embeddings takes one
`prompt` and answers one `embedding`. `options` and `keep_alive` are ignored; `dimensions` may only
be 384. The model is `all-minilm-l6-v2` (embeddings.model), `:latest` allowed.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from api.chat import json_dumps
from api.connections import reads_body_itself
from api.embeddings import DIMENSIONS, EmbeddingsRequest, embed_request
from api.errors import bad_request
from api.fields import kind_of, opt_bool
from api.ollama_request import resolve_model
from settings import EmbeddingsConfig


def _model(raw: Any, cfg: EmbeddingsConfig) -> str:
    if not isinstance(raw, dict):
        raise bad_request(f"The request body must be a JSON object, got {kind_of(raw)}.")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: the embeddings model's name from /api/tags.", param="model")
    dimensions = raw.get("dimensions")
    if dimensions is not None and (type(dimensions) is not int or dimensions != DIMENSIONS):
        raise bad_request(f"'dimensions' can only be {DIMENSIONS} for {cfg.model}.", param="dimensions")
    return resolve_model(model, frozenset({cfg.model}))


def _texts(value: Any, cfg: EmbeddingsConfig) -> tuple[str, ...]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise bad_request("'input' must be a non-empty string or an array of non-empty strings.", param="input")
    if len(texts) > cfg.max_inputs:
        raise bad_request(f"'input' has {len(texts)} items; at most {cfg.max_inputs} are allowed.", param="input")
    return tuple(texts)


def parse_embed(raw: Any, cfg: EmbeddingsConfig) -> EmbeddingsRequest:
    model = _model(raw, cfg)
    return EmbeddingsRequest(model, _texts(raw.get("input"), cfg), False, opt_bool(raw, "truncate", True))


def parse_embeddings(raw: Any, cfg: EmbeddingsConfig) -> EmbeddingsRequest:
    model = _model(raw, cfg)
    prompt = raw.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("'prompt' must be a non-empty string.", param="prompt")
    return EmbeddingsRequest(model, (prompt,), False)


@reads_body_itself
async def embed(request: web.Request) -> web.Response:
    done = await embed_request(request, parse_embed)
    body = {
        "model": done.request.model,
        "embeddings": done.vectors.tolist(),
        "total_duration": int(done.total_s * 1e9),
        "load_duration": 0,
        "prompt_eval_count": done.num_tokens,
    }
    return web.json_response(body, dumps=json_dumps, headers=done.headers)


@reads_body_itself
async def embeddings(request: web.Request) -> web.Response:
    done = await embed_request(request, parse_embeddings)
    return web.json_response({"embedding": done.vectors[0].tolist()}, dumps=json_dumps, headers=done.headers)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/api/embed", embed)
    app.router.add_post("/api/embeddings", embeddings)
