"""Every setting, declared once: typed frozen dataclasses with defaults and help text.

`load_settings` reads `config.toml` with tomllib, applies `--set section.key=value`
overrides, and rejects unknown keys and wrong types with an error naming the key.
This module must not import the engine, the store or aiohttp.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(Exception):
    """A configuration problem, reported at startup with the offending key."""


@dataclass(frozen=True, slots=True)
class Allowed:
    """The values a setting accepts beyond its type; a list or table setting applies it to each item.
    `choices` entries ending in ":N" accept any whole number there ("cuda:N": cuda:0, cuda:1...)."""

    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None  # exclusive lower bound: "more than"
    choices: tuple[str, ...] = ()
    ignore_case: bool = False

    def range_text(self) -> str:
        """The numeric range in words ("1 or more", "0 to 1"); empty when there is none."""
        high = None if self.maximum is None else _number(self.maximum)
        if self.minimum is not None:
            low = _number(self.minimum)
            return f"{low} or more" if high is None else f"{low} to {high}"
        if self.above is not None:
            low = f"more than {_number(self.above)}"
            return low if high is None else f"{low} and at most {high}"
        return "" if high is None else f"{high} or less"

    def problem(self, value: Any) -> str | None:
        """Why `value` is refused ("must be ..."), or None when it is allowed."""
        if self.choices and isinstance(value, str) and not any(self._matches(c, value) for c in self.choices):
            return f"must be one of {', '.join(self.choices)}; got {value!r}"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        too_low = (self.minimum is not None and value < self.minimum) or (
            self.above is not None and value <= self.above
        )
        if too_low or (self.maximum is not None and value > self.maximum):
            return f"must be {self.range_text()}; got {value!r}"
        return None

    def _matches(self, choice: str, value: str) -> bool:
        if self.ignore_case:
            choice, value = choice.upper(), value.upper()
        if choice.endswith(":N"):
            return value == choice[:-2] or re.fullmatch(re.escape(choice[:-1]) + r"\d+", value) is not None
        return value == choice


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def setting(
    default: Any,
    help: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    choices: tuple[str, ...] = (),
    ignore_case: bool = False,
) -> Any:
    """A config field with its default, its one line of documentation and the values it accepts
    (checked by `validate` for every setting; a numeric range is appended to the help text)."""
    allowed = Allowed(minimum, maximum, above, choices, ignore_case)
    text = allowed.range_text()
    metadata = {"help": f"{help} Allowed: {text}." if text else help, "allowed": allowed}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP server: address, request and connection limits, access control, logs."""

    host: str = setting("127.0.0.1", "Interface to bind; 127.0.0.1 keeps the server on this machine.")
    port: int = setting(8000, "TCP port.", minimum=0, maximum=65535)
    max_body_bytes: int = setting(
        20_971_520,
        "Largest request body accepted (20 MiB: a phone photo sent inline as a data: URL, as Open WebUI and "
        "LibreChat send images); bigger bodies get 413. Bodies are read only after the key check.",
        minimum=1,
    )
    max_messages: int = setting(1000, "Most messages one chat request may carry.", minimum=1)
    max_prompt_chars: int = setting(
        1_000_000,
        "Most characters of a prompt's text (messages, and tools' names, descriptions and schemas), and most token ids "
        "of a legacy completion's prompt, checked before tokenizing.",
        minimum=1,
    )
    shutdown_grace_s: float = setting(
        10.0, "On Ctrl-C/SIGTERM: how long running answers may finish before they are aborted.", minimum=0
    )
    heartbeat_s: float = setting(
        5.0, "SSE comment sent this often while a stream waits in the queue or prefills.", above=0
    )
    allow_public_without_keys: bool = setting(
        False, "Serve requests without an API key on a non-loopback address. Dangerous."
    )
    local_tier: str = setting(
        "enterprise", "Tier of requests without a key (only on loopback, or with allow_public_without_keys)."
    )
    require_keys: bool = setting(False, "true: every /v1 request needs an API key, even on 127.0.0.1.")
    cors_origins: list[str] = setting(
        [],
        'Origins (besides the UI\'s own) whose browser pages may call the API (CORS), e.g. ["http://localhost:3000"] '
        'for a browser front end; "*": any site, but then only with an API key. Empty: same-origin only.',
    )
    allowed_hosts: list[str] = setting(
        [],
        'Host header names accepted besides the bound address and localhost (blocks DNS rebinding); "*": any, keys '
        "then required.",
    )
    trusted_proxies: list[str] = setting(
        [],
        "Addresses of reverse proxies in front of this server. When set, the server refuses to start without "
        "require_keys = true.",
    )
    metrics_token: str = setting(
        "", "Bearer token for /metrics (an API key works too); needed when the server is not loopback-only."
    )
    tls_cert_file: str = setting(
        "",
        "PEM certificate chain to serve HTTPS directly, without a reverse proxy (with tls_key_file; both or "
        "neither). Empty: plain HTTP.",
    )
    tls_key_file: str = setting("", "PEM private key of tls_cert_file.")
    header_timeout_s: float = setting(
        10.0,
        "A request's headers must arrive within this many seconds of the connection (or the previous answer); else "
        "408 and close.",
        above=0,
    )
    body_timeout_s: float = setting(
        30.0,
        "A request's body must arrive within this many seconds after its headers, and a file upload may not pause "
        "longer than this between reads; else 408 and close.",
        above=0,
    )
    write_timeout_s: float = setting(
        30.0,
        "An answer whose bytes the client does not read for this many seconds is given up and the connection "
        "closed (a client that stops reading would otherwise hold its connection slot).",
        above=0,
    )
    max_connections: int = setting(
        1024,
        "Open connections in total (lowered to fit the open-files limit). At the cap the oldest idle (or "
        "still-sending) connection is closed, else the new one gets 503.",
        minimum=1,
    )
    max_connections_per_client: int = setting(
        256, "Open connections from one client address (all local clients share 127.0.0.1), same rule.", minimum=1
    )
    fd_reserve: int = setting(
        64,
        "File descriptors kept free of connections (database, model files, health checks); lowers max_connections to "
        "fit `ulimit -n`.",
        minimum=0,
    )
    backlog: int = setting(1024, "Pending connections the kernel queues before the server accepts them.", minimum=1)
    log_level: str = setting(
        "info",
        "debug, info, warning or error. Prompt text is only ever logged at debug.",
        choices=("debug", "info", "warning", "error"),
        ignore_case=True,
    )
    log_json: bool = setting(
        False, "true: one JSON object per log line (for log shippers); false: human-readable console lines."
    )
    static_dir: str = setting("static", "Folder of the web chat UI, served at /.")
    max_n: int = setting(
        8, "Most choices (`n`) one chat request may ask for; they share the prompt's KV blocks.", minimum=1
    )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The native PyTorch engine (backend = "native"): continuous batching over a paged KV cache."""

    device: str = setting(
        "auto", "cpu, cuda, cuda:N, or auto (cuda when present, else cpu).", choices=("auto", "cpu", "cuda", "cuda:N")
    )
    dtype: str = setting(
        "auto",
        "float32, bfloat16, float16, or auto (float32 on CPU, bfloat16 on CUDA).",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    num_threads: int = setting(0, "torch CPU threads; 0 lets torch decide.", minimum=0)
    block_size: int = setting(16, "Tokens per KV-cache block.", minimum=1)
    kv_cache_bytes: int = setting(0, "Size of the KV-cache pool in bytes; 0: use kv_cache_memory_fraction.", minimum=0)
    kv_cache_memory_fraction: float = setting(
        0.2,
        "Share of free memory (GPU memory on CUDA, RAM on CPU) for the KV pool when kv_cache_bytes is 0.",
        above=0,
        maximum=1,
    )
    max_num_seqs: int = setting(64, "Most sequences batched in one step.", minimum=1)
    max_num_batched_tokens: int = setting(
        512, "Token budget of one step: decode tokens plus prefill chunks.", minimum=1
    )
    max_prefill_tokens_while_decoding: int = setting(
        0,
        "Most prompt tokens prefilled in a step that also decodes running streams (or twice the number of those "
        "streams, if more), so a long prompt arriving does not stall them (on CPU a step's time grows with its "
        "tokens); 0: auto (32 on CPU, no cap on CUDA, where a step's time barely grows).",
        minimum=0,
    )
    enable_prefix_caching: bool = setting(
        True, "Reuse the KV blocks of identical prompt prefixes (e.g. the next chat turn)."
    )
    prefix_cache_scope: str = setting(
        "org",
        '"org": each organisation has its own cache (no timing leak across tenants); "shared".',
        choices=("org", "shared"),
    )
    prefix_cache_dir: str = setting(
        "auto",
        "Where the prefix cache is kept across restarts: at a clean stop each model writes its most recently used "
        "cached blocks here (one file per model folder) and reads them back at the next start, so conversations and "
        'long system prompts are warm again. "auto": a prefix-cache folder beside the database (store.path); '
        "empty: not kept.",
    )
    prefix_cache_save_bytes: int = setting(
        268_435_456, "Most bytes of KV written per model at a stop (the most recently used blocks first).", minimum=0
    )
    native_kernels: bool = setting(
        True,
        "On CPU with fp32, compile (once, with the system C compiler) and use the C kernels built for the CPU's "
        "widest instruction set, AVX-512 or AVX2+FMA: the linear layers from weights packed at load, fused "
        "RMSNorm/SiLU/RoPE, paged attention (1.8x to 2.5x the tokens/s of the PyTorch ops on the 2-core development "
        "VM); false: pure PyTorch, same tokens within fp32 rounding.",
    )
    kernel_isa: str = setting(
        "auto",
        'Which C kernels: "auto" (the widest the CPU reports), "avx512", "avx2" (to test or measure the AVX2 path on '
        'an AVX-512 CPU), "torch" (PyTorch ops). One the CPU lacks is an error at start.',
        choices=("auto", "avx512", "avx2", "torch"),
    )
    amx_prefill: str = setting(
        "auto",
        "On CPUs with AMX (Intel Xeon since Sapphire Rapids): steps of 32 or more tokens (prompts) run the decoder's "
        "matmuls and attention as bfloat16 on AMX tiles (oneDNN), from a bfloat16 copy of the weights (+50% weight "
        "memory), "
        "accumulating in fp32 (decoding tokens that share such a step too); steps with fewer tokens keep the fp32 "
        "kernels. Measured on a 390M model, "
        "2 cores: the first token of a 1,024-token prompt 3.5x sooner (bench/RESULTS.md). "
        '"auto": on for checkpoints stored in bfloat16 (the copy is then exact and '
        'the activations round as on a GPU), off for fp32 ones; "on" also for fp32 checkpoints; "off". Only with '
        'the avx512 kernels and unquantized weights ("on" otherwise is an error at start).',
        choices=("auto", "on", "off"),
    )
    speculative_tokens: int = setting(
        0,
        "Prompt-lookup speculation: while one greedy request runs alone, each step also feeds up to this many "
        "draft tokens copied from its own prompt or answer (what followed the last earlier occurrence of its "
        "latest 3 or 2 tokens) and keeps those the model agrees with, so a step can yield several tokens of the "
        "same greedy output (bench/RESULTS.md); 0: off.",
        minimum=0,
    )
    cuda_graphs: str = setting(
        "auto",
        '"auto": on CUDA, decode-only steps replay CUDA graphs, one captured per padded shape the first time it '
        "is needed (batch rounded up to 1, 2, 4, 8, 16, 24, ...; context to a power of two), so a step costs one "
        'launch instead of one per operation; "off": every step runs operation by operation; "eager": the same '
        "padded steps without capturing, to tell a padding fault from a capture fault (on the CPU it needs "
        'kernel_isa = "torch"). On the CPU, auto is off. Padded steps keep one KV block per layer beyond '
        "kv_cache_bytes for their padding rows.",
        choices=("auto", "off", "eager"),
    )
    quantization: str = setting(
        "none",
        "\"int8\": the linear layers' weights quantized once at load, one scale per 32 weights like llama.cpp's Q8_0 "
        '(a quarter of the fp32 bytes read per token); "int4": 4 bits a weight, one scale per 32 like Q4_0, the '
        "lm_head kept at int8, and each layer's inputs rounded to int8 per 32 (like Q8_0) so that the sums are "
        "integer dot products, as llama.cpp's Q4_0 (measured on a 390M model: 1.6-2.3x int8's speed, held-out "
        "perplexity +1.4% on the demo model, bench/RESULTS.md); on paths without these kernels the rounded weights "
        '(and int4\'s rounded inputs) are kept as floats; "none": as loaded.',
        choices=("none", "int8", "int4"),
    )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One [models.<name>] section per model; `.venv/bin/python server.py --model DIR` replaces all of them with DIR.
    A model served by other OpenAI-compatible servers (backend = "openai") needs no path; the keys
    marked openai are its own.
    """

    path: str = setting("", 'Local model folder in Hugging Face layout (backend = "openai": none needed).')
    backend: str = setting(
        "native",
        "native (the PyTorch engine), trtllm (NVIDIA GPU hosts, docs/trtllm.md), or openai (other OpenAI-compatible "
        "servers, docs/scale-out.md).",
    )
    max_model_len: int = setting(
        0,
        "Context window in tokens; 0: from the model's config.json (openai: from the upstream's /models, else none).",
        minimum=0,
    )
    price_input_per_mtok: float = setting(0.0, "USD per million prompt tokens.", minimum=0)
    price_cached_input_per_mtok: float = setting(0.0, "USD per million prompt tokens served from cache.", minimum=0)
    price_output_per_mtok: float = setting(0.0, "USD per million completion tokens.", minimum=0)
    fallback: str = setting("", "Model to serve this model's tier traffic when it is saturated; empty: none.")
    tool_parser: str = setting(
        "auto",
        "How the model writes tool calls: auto (picked from the chat template), hermes (<tool_call> JSON, as Qwen "
        "and Hermes), llama3_json (a bare JSON object, as Llama 3.1+) or mistral ([TOOL_CALLS]).",
    )
    thinking_budget: int = setting(
        -1,
        "native: most tokens a reasoning model (one that thinks in <think> tags, as Qwen3) may think per answer; "
        "then the server closes its thinking (thinking_budget_message, then </think>) and it answers. -1: no limit. "
        "A request's thinking_token_budget (Messages API: thinking.budget_tokens) replaces it.",
    )
    thinking_budget_message: str = setting(
        "\n\nI have to stop thinking here and give my answer now.\n",
        "native: text put into the thinking, before </think>, when a thinking budget runs out (so that the model "
        "answers from what it has); empty: </think> alone.",
    )
    idle_unload_s: float = setting(
        0.0,
        "native: load the model on its first request instead of at start, and unload it (its memory freed) after "
        "this many seconds with no request running; the next request loads it again (its prefix cache kept across, "
        "see engine.prefix_cache_dir). 0: loaded at start and kept.",
    )
    # backend = "openai" only (docs/scale-out.md):
    urls: list[str] = setting(
        [], 'openai: base URLs of the upstream replicas, e.g. ["http://gpu-a:8000/v1", "http://gpu-b:8000/v1"].'
    )
    upstream_model: str = setting(
        "", 'openai: the name the upstream knows the model by, e.g. "Qwen/Qwen3-8B"; empty: this model\'s name.'
    )
    api_key_env: str = setting(
        "", "openai: environment variable holding the upstream's API key (never logged); empty: none."
    )
    max_in_flight: int = setting(
        64, "openai: requests sent to one replica at once; the rest wait in our priority queue.", minimum=1
    )
    tokenizer: str = setting(
        "", "openai: local tokenizer folder for exact counts and context checks; empty: estimates."
    )


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One [tiers.<name>] section per tier. An organisation has a tier; its API keys inherit it."""

    priority: int = setting(0, "Higher is served first and preempted last.")
    requests_per_minute: int = setting(60, "Per-key request bucket size and refill per minute.", minimum=0)
    tokens_per_minute: int = setting(100_000, "Per-key token bucket (prompt + max_tokens) per minute.", minimum=0)
    tier_requests_per_minute: int = setting(0, "Bucket shared by the whole tier; 0: none.", minimum=0)
    tier_tokens_per_minute: int = setting(0, "Token bucket shared by the whole tier; 0: none.", minimum=0)
    max_tokens: int = setting(1024, "Largest max_tokens a request may ask for.", minimum=1)
    max_context_tokens: int = setting(4096, "Largest prompt + max_tokens.", minimum=1)
    max_thinking_tokens: int = setting(
        -1,
        "Most tokens a reasoning model served here (native, <think> tags of one token each) may think per answer "
        "for this tier: the server closes its thinking there, as a request's thinking_token_budget (the smaller "
        "wins); -1: no cap.",
    )
    max_concurrent_streams: int = setting(
        4,
        "Requests in flight per key; 429 above it, except keyless local use, whose extra requests wait for a stream.",
        minimum=1,
    )
    models: list[str] = setting([], "Models this tier may use, preferred first.")
    wait_target_s: float = setting(
        10.0,
        "Estimated queue wait above which the tier's next model serves, else 503; a tier is shed at the smallest "
        "target of itself and the tiers above it, and the top tier is never shed for waiting.",
        minimum=0,
    )
    retention_days: int = setting(30, "Days a deleted conversation is kept before it is purged.", minimum=0)
    budget_fallback: bool = setting(False, "Over budget: serve the tier's last model instead of answering 429.")
    file_storage_bytes: int = setting(104_857_600, "Bytes of uploaded files an organisation may keep.", minimum=0)
    max_files: int = setting(100, "Uploaded files an organisation may keep.", minimum=0)
    conversation_storage_bytes: int = setting(
        1_073_741_824,
        "Characters (about bytes) of conversation messages an organisation may keep, deleted conversations not "
        "counted; at the cap, storing more is a 400 conversation_quota_exceeded until some are deleted; 0: no cap.",
        minimum=0,
    )
    file_retention_days: int = setting(
        30, "Days an uploaded file is kept (its expires_at); 0: until deleted.", minimum=0
    )


# TierConfig fields an organisation may override for its own keys (`orgs set --limit`,
# PATCH /v1/admin/organizations/{name}); the rate limiter applies them per key.
ORG_LIMITS = ("requests_per_minute", "tokens_per_minute")


def merge_org_limits(limits: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`limits` with `changes` applied: a value sets a limit (a whole number >= 0, or its text), None
    removes it. ValueError naming the limit for an unknown name or a bad value."""
    merged = dict(limits)
    for name, value in changes.items():
        if name not in ORG_LIMITS:
            raise ValueError(f"{name!r} is not a limit an organisation can override; these are {', '.join(ORG_LIMITS)}")
        if value is None:
            merged.pop(name, None)
            continue
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise ValueError(f"limit {name}: expected a whole number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit {name}: expected a whole number >= 0, got {value!r}")
        merged[name] = value
    return merged


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """One bounded priority queue per model sits in front of the engine."""

    max_waiting_requests: int = setting(256, "Requests waiting per model; more get 503 with Retry-After.", minimum=0)
    max_waiting_tokens: int = setting(1_000_000, "Prompt + max_tokens waiting per model; more get 503.", minimum=0)
    max_wait_s: float = setting(60.0, "A request whose estimated wait is longer gets 503 at once.", minimum=0)
    aging_s: float = setting(
        10.0,
        "Every this many seconds of waiting raises a request's priority by one level, so lower tiers are served in "
        "bounded time. The wait counts across retries: a load refusal (503 queue_full, queue_wait_too_long or "
        "queue_displaced) starts a record for the API key, and the key's retries rank as if they had waited in line "
        "since then, until one gets into the engine. A record ends when the key has not been refused for 60 s (the "
        "longest Retry-After sent) + aging_s; "
        "4,096 keys are remembered (least recently refused forgotten first); keyless requests of one organisation "
        "are one key. 0: strict priority, no aging.",
        minimum=0,
    )
    age_retries: bool = setting(
        True,
        "Count a key's wait across its retries after load refusals (see aging_s). false: a refused request never "
        "ages, and a lower tier gets nothing while higher tiers alone fill the engine.",
    )


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The SQLite database of keys, conversations, files' metadata and the usage ledger."""

    path: str = setting("data/chat.db", "SQLite database (keys, conversations, usage ledger); created on first start.")
    synchronous: str = setting(
        "FULL",
        "SQLite synchronous mode. FULL: a finished answer and its ledger row survive power loss. NORMAL is faster.",
        choices=("OFF", "NORMAL", "FULL", "EXTRA"),
        ignore_case=True,
    )
    busy_timeout_ms: int = setting(5000, "How long a database connection waits for a lock.", minimum=0)
    purge_interval_s: float = setting(
        3600.0, "How often deleted conversations past their tier's retention are purged.", minimum=1
    )
    num_read_connections: int = setting(
        2, "Read-only connections (reads run concurrently; all writes go through one writer).", minimum=1
    )
    last_used_flush_s: float = setting(
        30.0, "How often API keys' last_used_at is written (coalesced, not one write per request).", above=0
    )
    key_cache_s: float = setting(
        5.0,
        "How long an API key's lookup is trusted in memory (re-read in the background every key_cache_s/2, so "
        "requests read no SQL): a key revoked or an organisation changed by another process (`server.py keys "
        "revoke`) is refused within this; through this server, at once. 0: read the database on every request.",
        minimum=0,
    )
    max_db_bytes: int = setting(
        0, "Largest database file; writes beyond it fail with 503 (visible in /ready). 0: no limit.", minimum=0
    )


@dataclass(frozen=True, slots=True)
class FilesConfig:
    """Uploaded files (POST /v1/files): bytes on disk addressed by id, metadata and owner in SQLite."""

    dir: str = setting("", 'Folder of uploaded files, one per id; empty: "files" beside the database (data/files).')
    max_file_bytes: int = setting(
        20_971_520,
        "Largest upload (20 MiB); refused with 413 as soon as the upload passes it, never held whole in memory.",
        minimum=1,
    )
    max_pdf_pages: int = setting(
        300, "Most pages of a PDF turned into text when a chat message refers to it.", minimum=1
    )
    max_document_chars: int = setting(
        400_000,
        "Most characters of a file's text that enter a prompt (bounds tokenizing on every turn); the header says "
        "when a file was cut here.",
        minimum=1,
    )
    max_extract_s: float = setting(
        30.0,
        "Deadline for turning one PDF into text. Each PDF is read once, in a child process that is killed when this "
        "passes (or the server stops); the file is then refused with 400 unreadable_file, and the refusal is "
        "remembered until this limit or max_extract_memory_bytes changes.",
        above=0,
    )
    max_extract_memory_bytes: int = setting(
        2_147_483_648,
        "Most memory (address space) one PDF reader process may use (2 GiB); a PDF that needs more (streams that "
        "inflate to tens of MB each) is refused with 400 unreadable_file.",
        minimum=1,
    )
    max_concurrent_extractions: int = setting(
        2,
        "Most PDFs read at once (each in its own child process, one core each); requests for a file being read "
        "wait for that reading, others wait their turn for at most max_extract_s, then get 503.",
        minimum=1,
    )
    max_files_per_request: int = setting(
        10,
        "Most file parts (input_file in the Responses API) in one chat request, uploaded images among them; more is "
        "refused with 400 too_many_files before any file is looked up or read.",
        minimum=0,
    )


@dataclass(frozen=True, slots=True)
class ImagesConfig:
    """Images in chat messages (image_url parts: data: URLs, uploaded file ids, or remote URLs when allowed)."""

    max_image_bytes: int = setting(
        10_485_760, "Largest encoded image (10 MiB): data: URL, uploaded file or fetched URL.", minimum=1
    )
    max_image_pixels: int = setting(
        16_777_216,
        "Most pixels (width x height) an image may declare; more is refused before decoding (decompression bombs).",
        minimum=1,
    )
    max_images_per_request: int = setting(8, "Most images in one chat request.", minimum=0)
    max_concurrent_decodes: int = setting(
        2,
        "Most images decoded, or read and checked, at once across all requests (threads of their own); others wait "
        "their turn.",
        minimum=1,
    )
    allow_remote_urls: bool = setting(
        False, "Fetch http(s) image URLs. Off: a server that fetches any URL is a door to SSRF."
    )
    remote_allow_hosts: list[str] = setting(
        [], 'When allowed: the only host names images are fetched from, e.g. ["images.example.com"].'
    )
    remote_timeout_s: float = setting(5.0, "Deadline of one remote image fetch (connect to last byte).", above=0)


@dataclass(frozen=True, slots=True)
class SafetyConfig:
    """Prompt screening and output filtering: rules and an embedding classifier (safety/README.md)."""

    enabled: bool = setting(True, "Screen prompts before the engine and filter answers while they stream.")
    block_mode: str = setting(
        "refusal",
        '"refusal": a normal answer with finish_reason content_filter; "error": HTTP 400 content_policy_violation.',
        choices=("refusal", "error"),
    )
    refusal_message: str = setting("I can't help with that.", "The refusal answer's text.")
    refusal_messages: dict[str, str] = setting(
        {
            "self_harm": "I can't help with that. If you are thinking about hurting yourself, please reach out "
            "now to someone you trust or to a local crisis line or emergency number: you don't have to face "
            "this alone.",
        },
        "Per-category refusal text (overrides refusal_message for that category); the default for self_harm points "
        "to crisis help.",
    )
    classifier: bool = setting(
        True, "Use the embedding classifier (all-MiniLM-L6-v2 + a trained head) besides the rules."
    )
    classifier_path: str = setting(
        "safety/classifier.npz", "The trained classifier: encoder adapter + head (make train-safety rebuilds it)."
    )
    threshold: float = setting(
        0.5,
        "Classifier score above which a category blocks a prompt (checked by 5-fold cross-validation on "
        'safety/train.jsonl: make train-safety ARGS="--cv 5").',
        minimum=0,
        maximum=1,
    )
    thresholds: dict[str, float] = setting(
        {},
        "Per-category prompt thresholds that override `threshold`, e.g. { malware = 0.6 }; --cv suggests some.",
        minimum=0,
        maximum=1,
    )
    output_threshold: float = setting(
        0.7, "Classifier score above which a streamed answer is cut off.", minimum=0, maximum=1
    )
    builtin_rules: bool = setting(
        True, "Use the built-in deny/allow patterns (gateway/safety/rules.py) besides those below."
    )
    deny: dict[str, list[str]] = setting(
        {},
        "Per-category regular expressions (case-insensitive) that block prompts and answers, e.g. { weapons = "
        '["build a bomb"] }.',
    )
    allow: list[str] = setting([], "Regular expressions whose matches are exempt from every category's deny rules.")
    allow_categories: dict[str, list[str]] = setting(
        {}, 'Per-category exemptions from that category\'s deny rules, e.g. { malware = ["capture the flag"] }.'
    )
    context_turns: int = setting(
        4, "How many of the latest user turns the classifier reads together (catches split requests).", minimum=1
    )
    max_windows: int = setting(
        4,
        "Classifier windows (128 tokens each) read per long message: its first and last ones; each is also scored "
        "alone.",
        minimum=1,
    )
    embed_dtype: str = setting(
        "auto",
        "Embedder matmuls: float32, bfloat16, int8 (weights quantized at load, 32 inputs per scale, float32 "
        "activations), w8a8 (7-bit weights per output channel and int8 activations per token, exact int32 sums: "
        "1.5-2.5x faster than float32, with or without VNNI; on AMX CPUs larger batches use oneDNN's AMX int8), or "
        "auto (w8a8 where the CPU has VNNI or the compiled kernels build, else int8). All meet the held-out "
        "targets (safety/README.md).",
        choices=("auto", "float32", "bfloat16", "int8", "w8a8"),
    )
    embed_cache_entries: int = setting(
        4096, "Per-message classifier features kept, so later turns do not re-embed history.", minimum=0
    )
    threads: int = setting(
        0,
        "CPU threads for the classifier when no native engine runs on the CPU (the engine on a GPU, TensorRT-LLM, "
        "relayed models); 0: all cores but two, at least two (one on a single core). Beside a native CPU engine "
        "the classifier runs on the engine's threads between its steps and this is ignored. On a GPU host one "
        "thread held the default configuration to 0.41x of safety off (bench/RESULTS.md).",
        minimum=0,
    )
    holdback_chars: int = setting(64, "Streamed text held back so that a blocked span is never sent.", minimum=0)
    output_classifier: bool = setting(
        True,
        "Also run the classifier on streamed answers (text waits for its check). Held-out: blocks 15/16 harmful "
        "answers, 3/40 benign ones and 1/90 demo-model texts (safety/README.md).",
    )
    output_check_chars: int = setting(
        160, "The answer classifier runs at least every this many new characters.", minimum=1
    )
    output_first_unchecked_chars: int = setting(
        16,
        "An answer's first characters, up to this many, are sent as soon as the deny rules allow, before the "
        "classifier reads them (with what follows, at its first check): a word or two it could not judge alone, "
        "so the first token is not held for a check (~5 ms on 2 cores). A block after them leaves them shown. "
        "0: nothing is sent before a check.",
        minimum=0,
    )


@dataclass(frozen=True, slots=True)
class TrtllmConfig:
    """TensorRT-LLM backend (backend = "trtllm" on a model; NVIDIA GPU hosts only, see docs/trtllm.md)."""

    tensor_parallel_size: int = setting(1, "GPUs one model is split across (tensor parallel).", minimum=1)
    pipeline_parallel_size: int = setting(1, "Pipeline-parallel stages.", minimum=1)
    max_batch_size: int = setting(64, "Most requests TensorRT-LLM batches at once.", minimum=1)
    max_num_tokens: int = setting(8192, "Token budget of one TensorRT-LLM iteration.", minimum=1)
    max_seq_len: int = setting(0, "Longest sequence; 0: from the model config.", minimum=0)
    kv_cache_free_gpu_memory_fraction: float = setting(
        0.9, "Share of free GPU memory for the KV cache.", above=0, maximum=1
    )
    kv_cache_host_bytes: int = setting(0, "Host memory for offloaded KV blocks; 0: none.", minimum=0)
    enable_block_reuse: bool = setting(True, "Prefix caching inside TensorRT-LLM.")
    enable_chunked_prefill: bool = setting(True, "Split long prompts across iterations.")
    scheduler_policy: str = setting(
        "guaranteed_no_evict",
        '"guaranteed_no_evict" or "max_utilization".',
        choices=("guaranteed_no_evict", "max_utilization"),
    )
    max_in_flight: int = setting(
        0, "Requests handed to TensorRT-LLM at once (our priority queue holds the rest); 0: max_batch_size.", minimum=0
    )
    stats_interval_s: float = setting(1.0, "How often executor stats are read for /metrics.", above=0)
    guided_decoding_backend: str = setting(
        "llguidance",
        'Grammar library TensorRT-LLM decodes response_format and forced tool calls with: "llguidance" (the native '
        'engine\'s; all of them), "xgrammar" (no forced tool calls) or "none" (such requests get a 400).',
        choices=("llguidance", "xgrammar", "none"),
    )


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Models with backend = "openai" are served by other OpenAI-compatible servers (vLLM, SGLang,
    llama.cpp's server, another instance of this one): see docs/scale-out.md.
    """

    connect_timeout_s: float = setting(5.0, "Seconds to open a connection to an upstream replica.", above=0)
    first_token_timeout_s: float = setting(
        120.0,
        "Seconds from sending a request to an upstream to its first text, reasoning or tool-call piece "
        "(response headers and prefill of a long prompt included).",
        above=0,
    )
    idle_timeout_s: float = setting(
        60.0, "Seconds an upstream stream may send no data between two chunks (SSE comments do not count).", above=0
    )
    max_attempts: int = setting(
        2, "Replicas tried for one request before its first token; never retried after a token was sent.", minimum=1
    )
    breaker_failures: int = setting(
        3,
        "Consecutive 5xx answers or timeouts that take a replica out; a refused or dropped connection takes it out "
        "at once.",
        minimum=1,
    )
    breaker_open_s: float = setting(
        5.0,
        "Seconds a replica stays out before it is probed (GET <url>/models) and, if it answers, let back in.",
        minimum=0,
    )
    affinity_entries: int = setting(
        100_000,
        "Conversations remembered so that their next turn goes to the replica holding their prefix cache.",
        minimum=0,
    )


@dataclass(frozen=True, slots=True)
class EmbeddingsConfig:
    """POST /v1/embeddings with the bundled all-MiniLM-L6-v2 sentence encoder (api/embeddings.py)."""

    enabled: bool = setting(True, "Serve POST /v1/embeddings (the encoder loads on the first request, ~90 MB).")
    model: str = setting("all-minilm-l6-v2", "The name requests give as `model` (384-dimensional embeddings).")
    dtype: str = setting(
        "float32",
        '"float32": the same vectors as sentence-transformers (to about 1e-6); "w8a8": int8 matmuls, 2.4x '
        "float32's speed on 1,024 tokens (2-core AMD EPYC, AVX-512 with VNNI), cosine similarity to float32's "
        "vectors 0.994 or more on the tests' sentences.",
        choices=("float32", "bfloat16", "int8", "w8a8"),
    )
    truncate: bool = setting(
        True,
        "Cut inputs longer than 256 tokens to their first 256 ([CLS] and [SEP] included), as sentence-transformers "
        "does; false: such an input is a 400 naming its index.",
    )
    max_inputs: int = setting(512, "Most inputs in one request.", minimum=1)
    price_input_per_mtok: float = setting(0.0, "USD per million input tokens, for the usage ledger.", minimum=0)


@dataclass(frozen=True, slots=True)
class TelemetryConfig:
    """OpenTelemetry traces: one span per generating request (api/telemetry.py), exported by OTLP over
    HTTP. Off unless an endpoint is set; no prompt or answer text is ever recorded."""

    otlp_traces_endpoint: str = setting(
        "",
        "Where spans go, e.g. http://localhost:4318/v1/traces (an OpenTelemetry Collector, Jaeger, Tempo, Phoenix); "
        "empty: no tracing. Headers such as an auth token come from OTEL_EXPORTER_OTLP_TRACES_HEADERS.",
    )
    service_name: str = setting("selfhosted-chat", "The spans' service.name.")
    export_timeout_s: float = setting(
        10.0,
        "Longest one export may take; at shutdown, the longest the server waits for the last spans to leave.",
        above=0,
    )


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
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
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
    return validate(_build(Settings, raw, ""))


def validate(settings: Settings) -> Settings:
    """`settings` when every value is one its setting allows (`setting(minimum=..., choices=...)`),
    else a ConfigError naming the first that is not. Run at load, and again by server.py after the
    --host/--port/--db flags are folded in."""
    _check_allowed(settings, "")
    return settings


def _check_allowed(obj: Any, where: str) -> None:
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), _join(where, f.name)
        if dataclasses.is_dataclass(value):
            _check_allowed(value, key)
        elif where == "" and f.name in _NAMED_SECTIONS:
            for name, item in value.items():
                _check_allowed(item, _join(key, name))
        elif (allowed := f.metadata.get("allowed")) is not None:
            if isinstance(value, dict):
                items = [(_join(key, k), v) for k, v in value.items()]
            else:
                items = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
            for item_key, item in items:
                if (problem := allowed.problem(item)) is not None:
                    raise ConfigError(f"{item_key} {problem}")


# Settings that name files or folders: (section, key, default, shipped). Relative values in a
# config file are relative to that file's folder, so the server finds its files from any
# working directory; so are the defaults of the user's data (the database), while the defaults
# of what ships with the server (the web UI, the safety classifier) stay in the project's
# folder, wherever the config file is (and so does a relative value of theirs that exists only
# there). --set and --db/--model values stay relative to the working directory, as shell
# arguments are.
_PATH_SETTINGS = (
    ("server", "static_dir", "static", True),
    ("store", "path", "data/chat.db", False),
    ("files", "dir", "", False),
    ("safety", "classifier_path", "safety/classifier.npz", True),
)
PROJECT_DIR = Path(__file__).resolve().parent


def _resolve_paths(raw: dict[str, Any], base: Path) -> None:
    for section, key, default, shipped in _PATH_SETTINGS:
        node = raw.setdefault(section, {})
        if not isinstance(node, dict):
            continue
        value = node.get(key, default)
        resolved = _resolve(value, base if key in node else PROJECT_DIR if shipped else base)
        if shipped and key in node and not Path(resolved).exists() and Path(_resolve(value, PROJECT_DIR)).exists():
            # A copy of config.toml moved out of the project names the shipped assets relative to
            # the project ("static"): found there, not silently missing beside the copy.
            resolved = _resolve(value, PROJECT_DIR)
        node[key] = resolved
    for model in (raw.get("models") or {}).values():
        for key in ("path", "tokenizer"):  # a model's folder, or a relayed model's tokenizer folder
            if isinstance(model, dict) and key in model:
                model[key] = _resolve(model[key], base)


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
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
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
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
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
            if isinstance(hint, type) and dataclasses.is_dataclass(hint):
                walk(hint, _join(prefix, f.name))
            elif prefix == "" and f.name in _NAMED_SECTIONS:
                walk(_NAMED_SECTIONS[f.name], f"{f.name}.<name>")
            else:
                factory = f.default_factory  # MISSING (not callable) unless the field has one
                default = factory() if callable(factory) else f.default
                rows.append((_join(prefix, f.name), default, f.metadata.get("help", "")))

    walk(Settings, "")
    return rows
