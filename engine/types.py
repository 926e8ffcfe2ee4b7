"""The request-level seam between the server and every inference backend.

Owns the value types that cross the seam (request in, token events out, stats) and the
`Backend` protocol. Nothing here knows about HTTP, tiers or a particular backend; backends
must not add their own fields to these types.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the context window reached
    ABORT = "abort"  # caller aborted (client gone, stop button, shutdown)
    CONTENT_FILTER = "content_filter"  # set by the safety gate, never by a backend


class StructuredKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # `spec` is a JSON schema (JSON text)
    LARK = "lark"  # `spec` is a Lark grammar (llguidance's dialect: `%json {...}` embeds a schema)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A grammar the completion must follow: decoding masks every token it does not allow."""

    kind: StructuredKind
    spec: str = ""


@dataclass(frozen=True, slots=True)
class TokenText:
    """A token named by its text, as an upstream server sends it (it has no ids to give)."""

    text: str
    utf8: tuple[int, ...] | None = None  # its bytes when the text alone cannot say (part of a character)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives (best first).

    A token is an id (the native engine: the API decodes it with the model's tokenizer) or a
    TokenText (an upstream server's text tokens); `token_id` is None exactly when `text` is set.
    """

    token_id: int | None
    logprob: float
    top_logprobs: tuple[tuple[int | TokenText, float], ...] = ()
    text: TokenText | None = None

    @property
    def token(self) -> int | TokenText:
        """The chosen token as the API names it: its text when the backend gave one, else its id."""
        if self.text is not None:
            return self.text
        if self.token_id is None:
            raise ValueError("a TokenLogprob names its token by id or by text")
        return self.token_id


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """A reasoning model's thinking (between its opening and closing tags, each one token), as
    the engine follows it: once `max_tokens` thinking tokens were generated, the next tokens are
    `forced_ids` (a short message, then the closing tag) whatever the model would pick; then it
    answers. The cap counts every thinking block of the answer together. A grammar
    (`structured`) constrains only the answer after the thinking."""

    max_tokens: int | None  # None: no cap (followed for a grammar only); 0: the block is closed at once
    open_id: int
    close_id: int
    forced_ids: tuple[int, ...]  # ends with close_id
    opened: bool = False  # the prompt itself ends inside a thinking block (the template opened it)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated sampling settings. `temperature == 0` means greedy."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS ids
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' and vLLM's: logits of tokens already in the prompt or output are divided by
    # it when positive, multiplied when negative (> 1 discourages repeats; 1 is off).
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    structured: StructuredOutput | None = None  # None: free text
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the top k (0-20)
    # None: none; k: each prompt token's logprob given the tokens before it, and the top k
    # (a legacy completion's echo with logprobs: what evaluation harnesses score). The native engine only.
    prompt_logprobs: int | None = None
    thinking: ThinkingBudget | None = None  # None: the model thinks as long as it likes
    # OpenAI's logit_bias: (token id, bias) pairs added to those tokens' logits before anything
    # else (-100 in practice bans a token, +100 makes it all but certain); sorted by id.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class UsageSource(enum.Enum):
    """Who counted a request's tokens (said in its ledger row)."""

    ENGINE = "engine"  # the engine in this process that ran the model
    UPSTREAM = "upstream"  # the usage an upstream server reported
    TOKENIZER = "tokenizer"  # the upstream reported none: recounted with the model's local tokenizer
    ESTIMATE = "estimate"  # no usage reported and no local tokenizer: estimated from the text


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """The prompt as chat messages, for backends that hand text to another server.

    `messages` are OpenAI message objects (stored history included, as rendered for the
    template); `options` are further validated request fields as the client sent them
    (tools, response_format, logprobs, n, ...), for servers that support them.
    """

    messages: tuple[Mapping[str, Any], ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    # A legacy completion's raw prompt (POST /v1/completions): relayed to the other server's
    # /completions as it is; `messages` is then empty.
    prompt: str | None = None


# Marks an image's place in a message's text for a vision model's tokenizer: a private-use
# character around a tag drawn once per process, so no text a client types or a model writes
# holds it (U+E000 alone, as icon fonts and PDF text hold, made an image slot).
IMAGE_PLACEHOLDER = f"\ue000{secrets.token_hex(16)}\ue000"


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt: `length` placeholder tokens from `offset` take its embeddings."""

    offset: int  # index in prompt_token_ids of its first image token
    length: int  # number of image tokens (rows of its embeddings)
    content_hash: str  # keys its tokens in the prefix cache: different images never share blocks
    pixel_values: Any  # preprocessed for the model (numpy float32 [channels, height, width])


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request as a backend sees it: token ids, not text (plus the chat, for text backends)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0  # higher runs first; preemption evicts the lowest first
    cache_salt: str | None = None  # prefix-cache namespace (per organisation); None: shared
    arrival_s: float = 0.0  # time.monotonic() when the request entered the server
    chat: ChatPrompt | None = None  # the same prompt as messages; token backends ignore it
    images: tuple[ImageInput, ...] = ()  # vision models only, in prompt order


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One streamed step of one request.

    `text` is the new, safe-to-show text (valid UTF-8, never part of a stop string);
    counts are cumulative. The last event of a request has `finish_reason` set.
    """

    text: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int
    num_completion_tokens: int
    finish_reason: FinishReason | None = None
    usage_source: UsageSource = UsageSource.ENGINE
    # When asked: one per generated token whose text is in the output, each on the event whose text
    # holds the token's first character (engine/detokenizer.py's LogprobGate; a relayed model's as
    # its upstream sends them); none for a stop string's tokens or those after it, nor a final EOS.
    logprobs: tuple[TokenLogprob, ...] = ()
    # When sampling.prompt_logprobs asked: one per prompt token (None for the first), on the first event only.
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()
    stop_str: str | None = None  # the stop string that ended the answer (finish_reason STOP), when one did


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for /metrics, /ready and the admission logic."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_free: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    num_prompt_tokens_processed: int = 0  # prefill tokens actually computed
    num_generation_tokens: int = 0
    num_draft_tokens: int = 0  # speculation (engine.speculative_tokens): draft tokens fed
    num_accepted_draft_tokens: int = 0  # of those, kept

    @property
    def kv_usage(self) -> float:
        if self.num_kv_blocks_total == 0:
            return 0.0
        return 1.0 - self.num_kv_blocks_free / self.num_kv_blocks_total


class EngineError(Exception):
    """A backend failed while serving a request (not the caller's fault): a 500/503."""


class EngineUnavailable(EngineError):
    """The backend cannot be reached right now (every upstream replica down): a 503 with Retry-After."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadFailed(EngineError):
    """A model loaded on demand could not be loaded (its folder is broken): a 503 naming the
    model; what went wrong is in the server's log, not sent to the caller."""

    def __init__(self, model: str):
        super().__init__(f"the model {model} could not be loaded")
        self.model = model


class RequestRejected(Exception):
    """A backend cannot serve this request as asked (the caller's fault): a 400.

    `param` names the offending request field, as in OpenAI's error envelope.
    """

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def check_fits_context(request: GenerationRequest, max_model_len: int) -> None:
    """Reject an empty prompt, or prompt + max_tokens beyond the context window, naming the numbers."""
    num_prompt = len(request.prompt_token_ids)
    total = num_prompt + request.sampling.max_tokens
    if num_prompt == 0:
        raise RequestRejected("the prompt is empty", param="messages")
    if total > max_model_len:
        raise RequestRejected(
            f"this model's context window is {max_model_len} tokens, but the request needs "
            f"{total} ({num_prompt} in the prompt + {request.sampling.max_tokens} max_tokens)",
            param="max_tokens",
            code="context_length_exceeded",
        )


@runtime_checkable
class Backend(Protocol):
    """What the server needs from an inference backend, per request.

    The native engine batches in its own scheduler; the TensorRT-LLM adapter hands each
    request to TensorRT-LLM's in-flight batcher. Both fit this shape.
    """

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + completion) one sequence may hold."""
        ...

    async def start(self) -> None:
        """Load weights and start workers; blocking work runs off the event loop."""
        ...

    async def shutdown(self) -> None:
        """Abort everything in flight and release the device."""
        ...

    def check_request(self, request: GenerationRequest) -> None:
        """Raise RequestRejected if this backend could never serve the request."""
        ...

    @property
    def max_num_running(self) -> int:
        """Most requests this backend runs at once (its batch); 0: no limit of its own.

        The gateway holds at most this many engine reservations, so requests beyond it wait
        in the gateway's priority queue rather than inside the backend.
        """
        ...

    def has_room(self) -> bool:
        """True when a new request would start promptly (the queue in front admits by this)."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenEvent, None]:
        """Stream events for one request; the last one carries finish_reason.

        Closing the iterator early (aclose, or cancellation of the consumer) aborts the
        request and frees its resources. Raises EngineError on backend failure.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still running; harmless if it already finished."""
        ...

    def stats(self) -> EngineStats: ...

    def health(self) -> bool:
        """False once the backend is dead and cannot recover."""
        ...
