"""Every setting, declared once: typed frozen dataclasses with defaults and help text.

`load_settings` reads `config.toml` with tomllib, applies `--set section.key=value`
overrides, and rejects unknown keys and wrong types with an error naming the key.
This module must not import the engine, the store or aiohttp.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(Exception):
    """A configuration problem, reported at startup with the offending key."""


def setting(default: Any, help: str) -> Any:  # noqa: A002 - 'help' reads best here
    """A config field with its default and its one line of documentation."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "Interface to bind; 127.0.0.1 keeps the server local.")
    port: int = setting(8000, "TCP port.")
    max_body_bytes: int = setting(1_048_576, "Largest request body accepted (413 above).")
    max_messages: int = setting(1000, "Most messages one chat request may carry.")
    max_prompt_chars: int = setting(1_000_000, "Most characters of message text before tokenizing.")
    shutdown_grace_s: float = setting(10.0, "On SIGINT/SIGTERM, how long running streams may finish.")
    heartbeat_s: float = setting(5.0, "SSE comment heartbeat interval while a stream waits or prefills.")
    allow_public_without_keys: bool = setting(
        False, "Serve keyless requests on a non-loopback address (dangerous; off by default)."
    )
    local_tier: str = setting("enterprise", "Tier of keyless requests when bound to loopback.")
    require_keys: bool = setting(False, "Require an API key on every /v1 request, even on loopback.")
    cors_origins: list[str] = setting(
        [], "Origins (besides the page's own) whose browser pages may make state-changing calls; empty: same-origin only."
    )
    allowed_hosts: list[str] = setting(
        [], "Host header names accepted besides the bound address and localhost; \"*\": any (never keyless)."
    )
    trusted_proxies: list[str] = setting(
        [], "Addresses of reverse proxies in front of this server; when set, keys are required (keyless start refused)."
    )
    metrics_token: str = setting("", "Bearer token that may read /metrics (besides any API key) when not loopback-only.")
    header_timeout_s: float = setting(10.0, "A request's headers must arrive within this (408 and close otherwise).")
    body_timeout_s: float = setting(30.0, "A request's body must arrive within this after its headers, and a file "
                                   "upload may not pause longer than this (408 otherwise).")
    max_connections: int = setting(1024, "Open connections in total (lowered to fit the open-files limit).")
    max_connections_per_client: int = setting(256, "Open connections from one client address.")
    fd_reserve: int = setting(64, "File descriptors kept free of connections (database, models, health checks).")
    backlog: int = setting(1024, "Pending connections the kernel queues before the server accepts them.")
    log_level: str = setting("info", "debug, info, warning or error.")
    log_json: bool = setting(False, "Log JSON lines instead of human-readable console lines.")
    static_dir: str = setting("static", "Folder of the web chat UI, served at /.")
    max_n: int = setting(8, "Most choices (`n`) one chat request may ask for.")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    device: str = setting("auto", "cpu, cuda, cuda:N, or auto (cuda when present, else cpu).")
    dtype: str = setting("auto", "float32, bfloat16, float16, or auto (fp32 on CPU, bf16 on CUDA).")
    num_threads: int = setting(0, "torch CPU threads; 0 lets torch decide.")
    block_size: int = setting(16, "Tokens per KV-cache block.")
    kv_cache_bytes: int = setting(0, "KV-cache pool size in bytes; 0: use kv_cache_memory_fraction.")
    kv_cache_memory_fraction: float = setting(
        0.2, "Share of free device memory (RAM on CPU) for the KV pool when kv_cache_bytes is 0."
    )
    max_num_seqs: int = setting(64, "Most sequences in one batch.")
    max_num_batched_tokens: int = setting(512, "Token budget of one step (decodes + prefill chunks).")
    max_prefill_tokens_while_decoding: int = setting(
        0,
        "Most prompt tokens prefilled in a step that also decodes running streams, or twice the "
        "number of those streams if that is more (bounds their inter-token latency while a long "
        "prompt prefills); 0: auto (32 on CPU, no cap on CUDA).",
    )
    enable_prefix_caching: bool = setting(True, "Reuse KV blocks of identical prompt prefixes.")
    prefix_cache_scope: str = setting(
        "org", "'org': cache salted per organisation (no cross-tenant timing leak); 'shared'."
    )
    native_kernels: bool = setting(
        True,
        "On CPU with fp32: compile (once, with the system C compiler) and use the C kernels built for"
        " the CPU's widest instruction set, AVX-512 or AVX2+FMA (linear layers from pre-packed weights,"
        " fused RMSNorm/SiLU/RoPE, paged attention); else, or false, pure PyTorch (same tokens, within"
        " fp32 rounding).",
    )
    kernel_isa: str = setting(
        "auto",
        "Which C kernels: auto (the widest the CPU reports), avx512, avx2 (e.g. to test or measure the"
        " AVX2 path on an AVX-512 CPU), or torch (PyTorch ops); one the CPU lacks is an error.",
    )
    quantization: str = setting(
        "none",
        "Weights of the linear layers: none (as loaded), or int8 (quantized once at load, a scale per"
        " 32 weights like llama.cpp's Q8_0: a quarter of the fp32 bytes read per token; on paths without"
        " int8 kernels the rounded weights are kept as floats).",
    )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str = setting("", "Local model folder in Hugging Face layout.")
    backend: str = setting(
        "native", "native (PyTorch engine), trtllm (GPU hosts), openai (other OpenAI-compatible servers), or echo (tests)."
    )
    max_model_len: int = setting(
        0, "Context window in tokens; 0: from the model's config.json (openai: from the upstream's /models, else none)."
    )
    price_input_per_mtok: float = setting(0.0, "USD per million prompt tokens.")
    price_cached_input_per_mtok: float = setting(0.0, "USD per million prompt tokens served from cache.")
    price_output_per_mtok: float = setting(0.0, "USD per million completion tokens.")
    fallback: str = setting("", "Model to serve this model's tier traffic when it is saturated.")
    tool_parser: str = setting(
        "auto", "Tool-call text format: auto (from the chat template), hermes, llama3_json or mistral."
    )
    # backend = "openai" only (docs/scale-out.md):
    urls: list[str] = setting([], "openai: base URLs of the upstream replicas, e.g. http://gpu-a:8000/v1.")
    upstream_model: str = setting("", "openai: the model name the upstream knows; empty: this model's name.")
    api_key_env: str = setting("", "openai: environment variable holding the upstream's API key; empty: none.")
    max_in_flight: int = setting(64, "openai: requests sent to one replica at once; the rest wait in our queue.")
    tokenizer: str = setting("", "openai: local tokenizer folder for exact counts and context checks; empty: estimate.")


@dataclass(frozen=True, slots=True)
class TierConfig:
    priority: int = setting(0, "Higher is served first and preempted last.")
    requests_per_minute: int = setting(60, "Per-key request bucket size and refill per minute.")
    tokens_per_minute: int = setting(100_000, "Per-key token bucket (prompt + max_tokens) per minute.")
    tier_requests_per_minute: int = setting(0, "Bucket shared by the whole tier; 0: none.")
    tier_tokens_per_minute: int = setting(0, "Token bucket shared by the whole tier; 0: none.")
    max_tokens: int = setting(1024, "Largest max_tokens a request may ask for.")
    max_context_tokens: int = setting(4096, "Largest prompt + max_tokens.")
    max_concurrent_streams: int = setting(
        4, "Requests in flight per key (429 above; keyless local use waits for a stream instead)."
    )
    models: list[str] = setting([], "Models this tier may use, preferred first.")
    wait_target_s: float = setting(
        10.0, "Estimated queue wait above which the router falls back, then sheds (never the top tier)."
    )
    retention_days: int = setting(30, "Days a deleted conversation is kept before purging.")
    budget_fallback: bool = setting(False, "Over budget: serve the tier's last model instead of 429.")
    file_storage_bytes: int = setting(104_857_600, "Bytes of uploaded files an organisation may keep.")
    max_files: int = setting(100, "Uploaded files an organisation may keep.")
    file_retention_days: int = setting(30, "Days an uploaded file is kept (its expires_at); 0: until deleted.")


@dataclass(frozen=True, slots=True)
class QueueConfig:
    max_waiting_requests: int = setting(256, "Requests waiting per model before 503.")
    max_waiting_tokens: int = setting(1_000_000, "Prompt + max_tokens waiting per model before 503.")
    max_wait_s: float = setting(60.0, "Estimated wait above which a request is refused with 503.")
    aging_s: float = setting(10.0, "Seconds of waiting that raise a request's priority by one level.")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    path: str = setting("data/chat.db", "SQLite database file (created on first start).")
    synchronous: str = setting("FULL", "SQLite synchronous mode: FULL survives power loss.")
    busy_timeout_ms: int = setting(5000, "How long a connection waits on a lock.")
    purge_interval_s: float = setting(3600.0, "How often deleted conversations are purged.")
    num_read_connections: int = setting(2, "Read-only connections; writes always use one writer.")
    last_used_flush_s: float = setting(30.0, "How often API keys' last_used_at is written (coalesced).")
    max_db_bytes: int = setting(0, "Largest database file; writes beyond it fail with 503. 0: no limit.")


@dataclass(frozen=True, slots=True)
class FilesConfig:
    dir: str = setting("", "Folder of uploaded files, one per id; empty: 'files' beside the database.")
    max_file_bytes: int = setting(
        20_971_520, "Largest upload; refused with 413 as soon as the stream passes it (never buffered whole)."
    )
    max_pdf_pages: int = setting(300, "Most pages read from a PDF when it is turned into text.")
    max_document_chars: int = setting(
        400_000, "Most characters of a document's text that enter a prompt (bounds tokenizing on every turn)."
    )


@dataclass(frozen=True, slots=True)
class ImagesConfig:
    max_image_bytes: int = setting(10_485_760, "Largest encoded image (data: URL, uploaded file or fetched URL).")
    max_image_pixels: int = setting(
        16_777_216, "Most pixels (width x height) an image may declare; more is refused as a decompression bomb."
    )
    max_images_per_request: int = setting(8, "Most images one chat request may carry.")
    allow_remote_urls: bool = setting(False, "Fetch http(s) image URLs (a door to SSRF: keep off unless needed).")
    remote_allow_hosts: list[str] = setting([], "Host names remote images may be fetched from when allowed.")
    remote_timeout_s: float = setting(5.0, "Deadline of one remote image fetch, connect to last byte.")


@dataclass(frozen=True, slots=True)
class SafetyConfig:
    enabled: bool = setting(True, "Screen prompts and filter streamed output.")
    block_mode: str = setting(
        "refusal", "'refusal': answer with finish_reason content_filter; 'error': 400 content_policy_violation."
    )
    refusal_message: str = setting("I can't help with that.", "Text of the refusal answer.")
    refusal_messages: dict[str, str] = setting(
        {
            "self_harm": "I can't help with that. If you are thinking about hurting yourself, please reach out "
            "now to someone you trust or to a local crisis line or emergency number: you don't have to face "
            "this alone.",
        },
        "Per-category refusal text (overrides refusal_message for that category).",
    )
    classifier: bool = setting(True, "Use the embedding classifier besides the rules.")
    classifier_path: str = setting("safety/classifier.npz", "Trained classifier head.")
    threshold: float = setting(0.5, "Default block threshold for classifier scores.")
    thresholds: dict[str, float] = setting({}, "Per-category block thresholds (override 'threshold').")
    output_threshold: float = setting(0.7, "Block threshold for the classifier on streamed answers.")
    builtin_rules: bool = setting(True, "Use the built-in deny/allow patterns (gateway/safety/rules.py) too.")
    deny: dict[str, list[str]] = setting(
        {}, "Per-category regular expressions (case-insensitive) that block prompts and answers."
    )
    allow: list[str] = setting([], "Regular expressions whose spans are exempt from every category's deny rules.")
    allow_categories: dict[str, list[str]] = setting(
        {}, "Per-category regular expressions whose spans are exempt from that category's deny rules."
    )
    context_turns: int = setting(4, "How many of the latest user turns the classifier reads together.")
    max_windows: int = setting(4, "Classifier windows (128 tokens) read per long message: its first and last ones.")
    embed_dtype: str = setting("auto", "Embedder matmul dtype: float32, bfloat16, or auto (bf16 where the CPU has AMX).")
    embed_cache_entries: int = setting(4096, "Per-message classifier features kept for later turns.")
    holdback_chars: int = setting(64, "Streamed text held back so a blocked span is never sent.")
    output_classifier: bool = setting(True, "Also run the classifier on streamed answers (text waits for its check).")
    output_check_chars: int = setting(160, "The answer classifier runs at least every this many new characters.")


@dataclass(frozen=True, slots=True)
class TrtllmConfig:
    tensor_parallel_size: int = setting(1, "GPUs one model is split over (tensor parallel).")
    pipeline_parallel_size: int = setting(1, "Pipeline-parallel stages.")
    max_batch_size: int = setting(64, "Most requests TensorRT-LLM batches at once.")
    max_num_tokens: int = setting(8192, "Token budget of one TensorRT-LLM iteration.")
    max_seq_len: int = setting(0, "Longest sequence; 0: from the model config.")
    kv_cache_free_gpu_memory_fraction: float = setting(0.9, "GPU memory share for the KV cache.")
    kv_cache_host_bytes: int = setting(0, "Host memory for offloaded KV blocks; 0: none.")
    enable_block_reuse: bool = setting(True, "Prefix caching inside TensorRT-LLM.")
    enable_chunked_prefill: bool = setting(True, "Split long prompts across iterations.")
    scheduler_policy: str = setting("guaranteed_no_evict", "guaranteed_no_evict or max_utilization.")
    max_in_flight: int = setting(0, "Requests handed to TensorRT-LLM at once; 0: max_batch_size.")
    stats_interval_s: float = setting(1.0, "How often executor stats are read.")


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    connect_timeout_s: float = setting(5.0, "Seconds to open a connection to an upstream replica.")
    first_token_timeout_s: float = setting(120.0, "Seconds an upstream may take to send its first chunk.")
    idle_timeout_s: float = setting(60.0, "Seconds an upstream stream may stay silent between chunks.")
    max_attempts: int = setting(2, "Replicas tried for one request before its first token (retries never follow a token).")
    breaker_failures: int = setting(3, "Consecutive 5xx or timeouts that take a replica out (a refused connection: at once).")
    breaker_open_s: float = setting(5.0, "Seconds a replica stays out before it is probed (GET /models) again.")
    affinity_entries: int = setting(100_000, "Conversations remembered for sending their turns to the same replica.")


@dataclass(frozen=True, slots=True)
class Settings:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    files: FilesConfig = field(default_factory=FilesConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    safety: SafetyConfig = field(default_factory=SafetyConfig)
    trtllm: TrtllmConfig = field(default_factory=TrtllmConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    models: dict[str, ModelConfig] = field(default_factory=dict)
    tiers: dict[str, TierConfig] = field(default_factory=dict)


# Sections whose keys are user-chosen names (e.g. [models.demo-mini]), each of one type.
_NAMED_SECTIONS: dict[str, type] = {"models": ModelConfig, "tiers": TierConfig}


def load_settings(path: Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Settings:
    """Parse the config file (if any), apply `section.key=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        _resolve_paths(raw, Path(path).resolve().parent)
    for item in overrides:
        _apply_override(raw, item)
    return _build(Settings, raw, "")


# Settings that name files or folders: (section, key, default). Relative values in a config
# file (and these defaults when it gives none) are relative to that file's folder, so the
# server finds its files from any working directory; --set and --db/--model values stay
# relative to the working directory, as shell arguments are.
_PATH_SETTINGS = (
    ("server", "static_dir", "static"), ("store", "path", "data/chat.db"), ("files", "dir", ""),
    ("safety", "classifier_path", "safety/classifier.npz"),
)


def _resolve_paths(raw: dict[str, Any], base: Path) -> None:
    for section, key, default in _PATH_SETTINGS:
        node = raw.setdefault(section, {})
        if isinstance(node, dict):
            node[key] = _resolve(node.get(key, default), base)
    for model in (raw.get("models") or {}).values():
        if isinstance(model, dict) and "path" in model:
            model["path"] = _resolve(model["path"], base)


def _resolve(value: Any, base: Path) -> Any:
    """Relative non-empty paths become absolute under base; anything else is left as it is
    (wrong types are reported by _build, naming the key)."""
    if not isinstance(value, str) or not value or value.startswith(":") or Path(value).is_absolute():
        return value
    return str(base / value)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    try:  # a TOML value (number, bool, quoted string, list); bare words are strings
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
    node[parts[-1]] = value


def _build(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown config key {_join(where, unknown[0])!r}")
    kwargs = {}
    for name, value in raw.items():
        key = _join(where, name)
        hint = hints[name]
        if where == "" and name in _NAMED_SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a table of named sections")
            item_cls = _NAMED_SECTIONS[name]
            kwargs[name] = {k: _build(item_cls, v, _join(key, k)) for k, v in value.items()}
        elif dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key)
        else:
            kwargs[name] = _coerce(hint, value, key)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _coerce(args[0], value, key)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return {k: _coerce(item, v, _join(key, k)) for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if not isinstance(value, hint):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
    return value


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def settings_help() -> list[tuple[str, Any, str]]:
    """(key, default, help) for every declared setting; used by docs and a test."""
    rows: list[tuple[str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, _join(prefix, f.name))
            elif prefix == "" and f.name in _NAMED_SECTIONS:
                walk(_NAMED_SECTIONS[f.name], f"{f.name}.<name>")
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                rows.append((_join(prefix, f.name), default, f.metadata.get("help", "")))

    walk(Settings, "")
    return rows
