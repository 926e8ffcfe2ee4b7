"""The sections of the data and the features around the engine: [store], [files], [images],
[safety], [moderations], [embeddings], [sharing] and [telemetry]. Declarations only: loading and
checking are in loading.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from settings.fields import setting

DEFAULT_STORE_PATH = "data/chat.db"  # relative to the project folder (the shipped config.toml's)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The SQLite database of keys, conversations, files' metadata and the usage ledger."""

    path: str = setting(
        DEFAULT_STORE_PATH, "SQLite database (keys, conversations, usage ledger); created on first start."
    )
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
        "Largest upload (20 MiB); refused with 413 as soon as the upload passes it, never held whole in memory. "
        "Also the largest file sent inline in a request (file_data, an Anthropic document block; 400 "
        "file_too_large), within server.max_body_bytes.",
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
    max_text_memory_chars: int = setting(
        16_000_000,
        "Most characters of extracted file text kept in memory (the most recently used files'), so that a "
        "conversation's files are not read from disk again on every turn; each file is read from disk once "
        "either way (a file sent inline, kept by its bytes' hash, is read again from its message when its text "
        "is not here). 0: none kept.",
        minimum=0,
    )
    max_files_per_request: int = setting(
        10,
        "Most file parts (input_file in the Responses API, document blocks in Anthropic's), uploaded or sent "
        "inline, in one chat request, uploaded images among them; more is "
        "refused with 400 too_many_files before any file is looked up or read. The files of a conversation's "
        "earlier turns do not count (see max_text_memory_chars).",
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
    prepared_cache_mb: int = setting(
        128,
        "Per vision model: images kept decoded and preprocessed (by their bytes' sha256), so an image in a "
        "conversation's history is not decoded again each turn (a 336x336 CLIP input takes 1.3 MB; 0: none kept).",
        minimum=0,
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
        4096,
        "Per-message classifier features kept, so later turns do not re-embed history (about 27 KB for a "
        "260-token message: about 110 MB when all 4,096 are held).",
        minimum=0,
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
class ModerationsConfig:
    """POST /v1/moderations, answered by the safety gate's rules and classifier (api/moderations.py); served
    while safety.enabled is true, with the same thresholds and rules as prompt screening."""

    max_inputs: int = setting(
        32, "Most inputs in one request (strings, or the parts of one multimodal input); 400 above it.", minimum=1
    )
    max_chars: int = setting(
        32_000,
        "Most characters in one request, its inputs together; 400 above it. The rules read every character, on the "
        "CPU engine's thread between its steps (~0.4 ms per 1,000 characters on 2 cores).",
        minimum=1,
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
class SharingConfig:
    """Share links (api/shares.py): a read-only snapshot of a conversation that anyone with its link, and
    the means to reach this server, may read without a key, at /share/<token> (a page) and
    /v1/shared/<token> (JSON)."""

    enabled: bool = setting(
        True,
        "Let organisations create share links (POST /v1/conversations/{id}/shares; the web chat's Share button). "
        "Off: creating or updating one is a 403 sharing_disabled and every link answers 404 (none is deleted: "
        "turned on again, they answer again); listing and revoking still work, the list says so in "
        "X-Sharing-Enabled, and the web chat shows no Share button.",
    )
    reads_per_minute: int = setting(
        120,
        "Reads of links without a key (/share/<token> and /v1/shared/<token>, found or not) one client address may "
        "make per minute, a bucket of that size refilled over the minute; past it a 429 with Retry-After. An IPv6 "
        "address counts by its /64; readers through a server.trusted_proxies proxy share its address, so this "
        "does not apply to them: rate-limit at the proxy. 0: no limit.",
        minimum=0,
    )
    public_base_url: str = setting(
        "",
        "The origin links are given under (the API's share `url`, the web chat's Share dialog), e.g. "
        '"https://chat.example.com": a scheme, a name and a port alone. Empty: the scheme of the request that asks '
        "(a server.trusted_proxies proxy's X-Forwarded-Proto) and its Host (one the server accepts: its address, "
        "localhost or one of server.allowed_hosts). Set it behind a proxy that sends no X-Forwarded-Proto.",
    )


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
