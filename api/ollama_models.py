"""Ollama's model endpoints: GET /api/tags, /api/ps, /api/version, POST /api/show; and the model
management endpoints this server does not have (/api/pull, /api/create...), refused clearly.

Each lists or shows only the models the caller's tier may use (as GET /v1/models), named with
Ollama's default tag (`tiny:latest`; requests may leave it out), and the embeddings model when
embeddings are served. What a model folder tells is filled in, read once per process: `size`
(the safetensors files' bytes), `details` (family from config.json's model_type, format
"safetensors", parameter count and dtype from the safetensors headers), `modified_at`
(config.json's time), `digest` (sha256 of config.json and the safetensors tensors: names,
shapes, dtypes; not of the weights' bytes). A relayed model (backend "openai") has no folder:
those fields are empty. /api/show adds `model_info` (architecture, parameter count, context
length as the caller's tier may use it, layer and head counts), the chat `template`, the
checkpoint's sampling defaults as `parameters`, and `capabilities`.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from safetensors import SafetensorError, safe_open

from api.chat import json_dumps, read_json
from api.errors import ApiError, bad_request, not_found
from api.image_job import prompter_of
from api.ollama_request import resolve_model
from api.state import PRINCIPAL, STATE, AppState
from engine.registry import ModelHandle
from engine.tokenizer import Tokenizer
from gateway.safety.embedder import default_model_dir

# The Ollama API level whose request and answer shapes this server follows; clients gate
# features (structured outputs, `think`, tool calls) on /api/version.
OLLAMA_VERSION = "0.12.6"
_SAMPLING_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repeat_penalty",
}


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What a model folder says about itself (empty for a model without one)."""

    config: dict[str, Any]
    num_bytes: int
    num_params: int
    dtype: str
    digest: str
    modified_at: str | None  # RFC 3339; None when unknown


@functools.lru_cache(maxsize=64)
def checkpoint(model_dir: str) -> Checkpoint:
    folder = Path(model_dir) if model_dir else None
    if folder is None or not (folder / "config.json").is_file():
        return Checkpoint({}, 0, 0, "", "", None)
    digest = hashlib.sha256()
    raw_config = (folder / "config.json").read_bytes()
    digest.update(raw_config)
    num_bytes = num_params = 0
    dtypes: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors = _tensor_shapes(file)
        digest.update(orjson.dumps(tensors))
        num_bytes += file.stat().st_size
        for _name, dtype, shape in tensors:
            count = math.prod(shape)
            num_params += count
            dtypes[dtype] = dtypes.get(dtype, 0) + count
    modified = datetime.fromtimestamp((folder / "config.json").stat().st_mtime, UTC)
    config = orjson.loads(raw_config)
    return Checkpoint(
        config if isinstance(config, dict) else {},
        num_bytes,
        num_params,
        max(dtypes, key=dtypes.__getitem__) if dtypes else "",
        digest.hexdigest(),
        modified.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    )


def _tensor_shapes(file: Path) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of each tensor a safetensors file holds, from its header (the
    safetensors library maps the file; no tensor is read); none for a file it cannot open."""
    try:
        with safe_open(str(file), framework="numpy") as f:
            slices = [(name, f.get_slice(name)) for name in sorted(f.keys())]
            return [(name, s.get_dtype(), list(s.get_shape())) for name, s in slices]
    except (OSError, SafetensorError):
        return []


def parameter_size(num_params: int) -> str:
    """Ollama's way of writing a parameter count: 8.0B, 22.7M, 35.0K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if num_params >= scale:
            return f"{num_params / scale:.1f}{unit}"
    return str(num_params)


def tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def _details(ckpt: Checkpoint) -> dict[str, Any]:
    family = str(ckpt.config.get("model_type", ""))
    return {
        "parent_model": "",
        "format": "safetensors" if ckpt.num_bytes else "",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": parameter_size(ckpt.num_params) if ckpt.num_params else "",
        "quantization_level": ckpt.dtype,
    }


def _entry(handle: ModelHandle) -> dict[str, Any]:
    ckpt = checkpoint(handle.config.path or "")
    return {
        "name": tagged(handle.name),
        "model": tagged(handle.name),
        "modified_at": ckpt.modified_at,
        "size": ckpt.num_bytes,
        "digest": ckpt.digest,
        "details": _details(ckpt),
    }


def _embedding_entry(state: AppState) -> dict[str, Any] | None:
    if state.embeddings is None:
        return None
    name = tagged(state.embeddings.cfg.model)
    ckpt = checkpoint(str(default_model_dir()))  # the bundled all-MiniLM-L6-v2's own folder
    details = {**_details(ckpt), "quantization_level": state.embeddings.cfg.dtype.upper()}
    return {"name": name, "model": name, "modified_at": None, "size": 0, "digest": "", "details": details}


def _tier_handles(request: web.Request) -> list[ModelHandle]:
    state = request.app[STATE]
    tier_name, _ = state.tier_of(request[PRINCIPAL])
    return [state.models[name] for name in state.admission.router.models_for_tier(tier_name)]


def _context_length(request: web.Request, handle: ModelHandle) -> int:
    """The most prompt + answer tokens the caller can use with the model."""
    _, tier = request.app[STATE].tier_of(request[PRINCIPAL])
    return min(handle.max_model_len, tier.max_context_tokens)


def capabilities(handle: ModelHandle) -> list[str]:
    """Ollama's capability names, as far as this server knows them: every chat model takes tools
    (a template that does not render them gets them described in a system message)."""
    out = ["completion"]
    if handle.serves_chat:
        out.append("tools")
    if prompter_of(handle) is not None:
        out.append("vision")
    if isinstance(handle.tokenizer, Tokenizer) and handle.tokenizer.thinks:
        out.append("thinking")
    return out


def _model_info(handle: ModelHandle, context_length: int) -> dict[str, Any]:
    ckpt = checkpoint(handle.config.path or "")
    arch = str(ckpt.config.get("model_type", "")) or "unknown"
    info: dict[str, Any] = {"general.architecture": arch, f"{arch}.context_length": context_length}
    if ckpt.num_params:
        info["general.parameter_count"] = ckpt.num_params
    fields = {
        "embedding_length": "hidden_size",
        "block_count": "num_hidden_layers",
        "feed_forward_length": "intermediate_size",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "vocab_size": "vocab_size",
    }
    info.update({f"{arch}.{ours}": ckpt.config[theirs] for ours, theirs in fields.items() if theirs in ckpt.config})
    return info


def _parameters(handle: ModelHandle) -> str:
    """The checkpoint's sampling defaults (generation_config.json), as Ollama's `parameters` text."""
    defaults = handle.tokenizer.generation_defaults if isinstance(handle.tokenizer, Tokenizer) else {}
    return "\n".join(f"{_SAMPLING_NAMES[k]:<30} {v}" for k, v in defaults.items() if k in _SAMPLING_NAMES)


# -- the routes ---------------------------------------------------------------------------


async def version(_request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION})


async def tags(request: web.Request) -> web.Response:
    models = [_entry(h) for h in _tier_handles(request)]
    embedding = _embedding_entry(request.app[STATE])
    return web.json_response({"models": models + ([embedding] if embedding else [])}, dumps=json_dumps)


async def ps(request: web.Request) -> web.Response:
    """The models loaded now (a model loaded on demand, idle_unload_s, only while it is)."""
    loaded = [h for h in _tier_handles(request) if getattr(h.backend, "is_loaded", True) is not False]
    models = [{**_entry(h), "context_length": _context_length(request, h)} for h in loaded]
    return web.json_response({"models": models}, dumps=json_dumps)


async def show(request: web.Request) -> web.Response:
    raw = await read_json(request)
    name = raw.get("model", raw.get("name")) if isinstance(raw, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("'model' is required: a model name from /api/tags.", param="model")
    embedding = _embedding_entry(request.app[STATE])
    if embedding is not None and embedding["name"] == tagged(name):
        return web.json_response(_show_embedding(embedding), dumps=json_dumps)
    handles = {h.name: h for h in _tier_handles(request)}
    resolved = resolve_model(name, frozenset(handles))
    if resolved not in handles:
        raise not_found(f"model '{name}' not found (see /api/tags)", code="model_not_found", param="model")
    handle = handles[resolved]
    ckpt = checkpoint(handle.config.path or "")
    template = handle.tokenizer.chat_template if isinstance(handle.tokenizer, Tokenizer) else None
    body = {
        "modelfile": "",  # no Modelfile: the model is a folder named in config.toml
        "parameters": _parameters(handle),
        "template": template or "",
        "details": _details(ckpt),
        "model_info": _model_info(handle, _context_length(request, handle)),
        "capabilities": capabilities(handle),
        "modified_at": ckpt.modified_at,
    }
    return web.json_response(body, dumps=json_dumps)


def _show_embedding(entry: dict[str, Any]) -> dict[str, Any]:
    info = {"general.architecture": "bert", "bert.context_length": 256, "bert.embedding_length": 384}
    return {
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": entry["details"],
        "model_info": info,
        "capabilities": ["embedding"],
    }


async def not_served(request: web.Request) -> web.Response:
    """Model management that this server does not do: its models are folders named in config.toml."""
    raise ApiError(
        501,
        f"{request.method} {request.path} is not supported by this server: it does not download, create, copy or "
        "delete models; its models are configured by the operator (config.toml). See /api/tags for those you may use.",
        "invalid_request_error",
        "not_supported",
    )


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/version", version)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    app.router.add_post("/api/show", show)
    for path in ("/api/pull", "/api/push", "/api/create", "/api/copy"):
        app.router.add_post(path, not_served)
    app.router.add_delete("/api/delete", not_served)
    app.router.add_route("*", "/api/blobs/{digest}", not_served)
