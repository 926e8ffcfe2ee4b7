"""The sections of the model backends: [engine] (the native PyTorch engine), [models.<name>],
[trtllm] and [upstream] (models relayed to other OpenAI-compatible servers). Declarations only:
loading and checking are in loading.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from settings.fields import setting


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
    kv_cache_bytes: int = setting(
        0,
        "Size of the KV-cache pool in bytes; 0: use kv_cache_memory_fraction. A model with Gated DeltaNet "
        "layers (Qwen3.5) also holds a recurrent state per max_num_seqs sequence, on top of this (out of the "
        "fraction when 0).",
        minimum=0,
    )
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
        "the activations round as on a GPU) whose float32 weights and copies take at most 60% of the memory "
        'available at start (else off, logged amx_prefill_off_for_memory), off for fp32 ones; "on" also for fp32 '
        'checkpoints and whatever the memory; "off" (greedy answers then do not depend on what shares the batch: '
        "with AMX, decode rows sharing a long prompt's step and recomputed answers run in bf16). Only with "
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
    """One [models.<name>] section per model; `.venv/bin/python server.py --model DIR` serves DIR alone, with the
    settings of the section named as --model names DIR (its folder's name), but for its path and fallback.
    A model served by other OpenAI-compatible servers (backend = "openai") needs no path; the keys
    marked openai are its own.
    """

    path: str = setting(
        "",
        "Local model folder in Hugging Face layout: config.json, tokenizer files, *.safetensors (not GGUF; nothing "
        'is downloaded). backend = "openai": none needed.',
    )
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
    chat_template_name: str = setting(
        "",
        "Which of the model folder's named chat templates renders all its chats (tokenizer_config.json's "
        'chat_template list, or additional_chat_templates/<name>.jinja), e.g. "tool_use"; empty: as transformers, '
        'the one named "tool_use" for requests with tools (tool_choice not "none") if there is one, else the one '
        'named "default" (a folder whose templates have none so named is refused at start, naming them).',
    )
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
