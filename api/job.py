"""Turns a validated chat request into a ready-to-queue `Job`: model, context, token ids.

Owns step 5 of the request path (docs/architecture.md): for the model the router chose, the
prompt's token ids (api/prompt.py: history + new messages, the oldest turns trimmed only for
conversations), the completion's size and the context window's check with errors that name the
numbers, and the sampling parameters. Nothing is routed, queued or generated here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

from api.errors import ApiError, bad_request, not_found
from api.prompt import (
    build_context,
    chat_prompt,
    chat_template_of,
    encode_chat,
    encode_raw_prompt,
    prompt_tools,
    raw_chat_prompt,
    trim_history,
)
from api.protocol import ChatMessage, ChatRequest
from api.reasoning import prompt_opens_thinking
from api.tools import ChoiceMode, Tool, detect_format, forced_call_grammar
from engine.registry import ModelHandle
from engine.tokenizer import PromptTooLong, Tokenizer, knows_thinking
from engine.types import (
    FinishReason,
    GenerationRequest,
    RequestRejected,
    SamplingParams,
    ThinkingBudget,
    TokenLogprob,
    UsageSource,
)
from settings import TierConfig
from store.types import Principal


def choice_seed(seed: int, choice: int) -> int:
    """A seed for choice `choice` (> 0) of a request seeded `seed`, unrelated to other seeds' choices."""
    digest = hashlib.blake2b(f"{seed}:{choice}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


@dataclass(slots=True)
class Job:
    """Everything one chat request carries through admission, generation and billing (a request
    and its answer, not a turn of a conversation)."""

    request_id: str
    principal: Principal
    tier_name: str
    tier: TierConfig
    chat: ChatRequest
    model: ModelHandle
    fallback_from: str | None
    context: list[ChatMessage]
    gen: GenerationRequest
    arrival_s: float
    created_at: float
    history_messages_dropped: int = 0
    new_messages: tuple[tuple[str, str], ...] = ()
    new_message_parts: tuple[str | None, ...] = ()  # per new message: its parts as JSON (attachments), or None
    truncated_files: tuple[dict, ...] = ()  # files cut to fit the context (truncation: auto)
    fallback_reason: str | None = None  # with fallback_from: "busy" or "over_budget" (gateway/router.py)
    # filled while serving
    admitted_s: float | None = None
    first_token_s: float | None = None
    num_cached_tokens: int = 0
    num_completion_tokens: int = 0
    text_parts: list[str] = field(default_factory=list)  # choice 0's text (stored, safety-checked)
    completion_tokens_by_choice: list[int] = field(default_factory=list)  # n > 1: each choice's count
    reasoning_tokens_by_choice: list[int] = field(default_factory=list)  # of those, thinking (a reasoning model)
    # None: the model does not reason in <think> tags; else whether the prompt opened <think>
    reasoning_opened: bool | None = None
    recorded: bool = False  # set by the one finish path; a second call is a no-op
    finished_as: FinishReason | None = None  # the finish reason that path recorded
    turn_stored: bool = False  # that path wrote the turn into its conversation
    reported_prompt_tokens: int | None = None  # a backend's own count (an upstream's usage), if it reported one
    usage_source: UsageSource = UsageSource.ENGINE
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()  # when the request asked (a legacy completion's echo)
    stop_str: str | None = None  # the stop string that ended choice 0, when one did
    trace_parent: Any = None  # with tracing on: the caller's W3C trace context (api/telemetry.py), if it sent one

    @property
    def num_prompt_tokens(self) -> int:
        if self.reported_prompt_tokens is not None:
            return self.reported_prompt_tokens
        return len(self.gen.prompt_token_ids)

    @property
    def num_reasoning_tokens(self) -> int:
        return sum(self.reasoning_tokens_by_choice)

    @property
    def num_tokens_reserved(self) -> int:
        """Prompt + n x max_tokens: what the request holds in the token buckets and the queue."""
        return self.num_prompt_tokens + self.chat.n * self.gen.sampling.max_tokens

    def gen_for(self, choice: int) -> GenerationRequest:
        """Choice `choice` of n: its own request id and seed, the same prompt. Choice 0 keeps the
        request's seed (n = 1 answers do not change); the others get one mixed from (seed, choice),
        not seed + choice, which made seed 2's first choice repeat seed 1's second in a seed sweep."""
        if choice == 0:
            return self.gen
        seed = self.gen.sampling.seed
        sampling = dataclasses.replace(self.gen.sampling, seed=None if seed is None else choice_seed(seed, choice))
        return dataclasses.replace(self.gen, request_id=f"{self.gen.request_id}-{choice}", sampling=sampling)

    @property
    def completion_id(self) -> str:
        return "chatcmpl-" + self.request_id.removeprefix("req_")


def check_tool_results(messages: tuple[ChatMessage, ...]) -> None:
    """A tool message must answer a call an earlier assistant message made (OpenAI's 400): a
    result for an unknown id is a client bug the model would otherwise be asked to make sense of.
    Only for requests that carry their whole history (a stored conversation's calls are its own)."""
    made: set[str] = set()
    for i, message in enumerate(messages):
        made.update(call.id for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in made:
            raise bad_request(
                f"'messages[{i}]' is a tool result for {message.tool_call_id!r}, which no earlier assistant "
                "message's 'tool_calls' made.",
                param=f"messages[{i}].tool_call_id",
            )


def resolve_max_tokens(chat: ChatRequest, tier: TierConfig, tier_name: str, room: int) -> int:
    """The completion budget: asked for (within the tier's limit) or all the room left."""
    if chat.max_tokens is not None and chat.max_tokens_is_cap:
        return max(min(chat.max_tokens, tier.max_tokens, room), 1)  # no room at all: check_fits says so
    if chat.max_tokens is not None and chat.max_tokens > tier.max_tokens:
        raise bad_request(
            f"max_tokens is {chat.max_tokens}, but the '{tier_name}' tier allows at most {tier.max_tokens}.",
            param="max_tokens",
        )
    return chat.max_tokens if chat.max_tokens is not None else min(tier.max_tokens, room)


def check_fits(num_prompt: int, max_tokens: int, limit: int, model_name: str, where: str = "messages") -> None:
    """`where`: the field that holds the prompt (`messages`, or a legacy completion's `prompt`)."""
    if num_prompt + max_tokens <= limit and num_prompt < limit:
        return
    raise context_too_long(num_prompt, max_tokens, limit, model_name, where)


def context_too_long(
    num_prompt: int, max_tokens: int, limit: int, model_name: str, where: str, *, is_lower_bound: bool = False
) -> ApiError:
    """OpenAI's context_length_exceeded; `is_lower_bound`: `num_prompt` is the tokenizer's bound
    on a prompt refused untokenized (engine/token_bound.py), not its count."""
    at_least = "at least " if is_lower_bound else ""
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens. However, you requested {at_least}"
        f"{num_prompt + max_tokens} tokens ({at_least}{num_prompt} in the {where}, {max_tokens} in the "
        f"completion). Please reduce the length of the {where} or completion. (model: {model_name})",
        "invalid_request_error",
        "context_length_exceeded",
        where,
    )


def min_completion_tokens(chat: ChatRequest) -> int:
    """The fewest completion tokens the request can be given (max_tokens unless it is only a cap):
    a prompt longer than the context less these cannot fit (check_fits)."""
    return chat.max_tokens if chat.max_tokens is not None and not chat.max_tokens_is_cap else 1


def _sampling_defaults(chat: ChatRequest, model: ModelHandle | None) -> dict:
    """temperature, top_p, top_k and repetition_penalty: as sent, else the model's
    generation_config.json, else OpenAI's (repetition_penalty: 1, off)."""
    values = {
        "temperature": chat.temperature,
        "top_p": chat.top_p,
        "top_k": chat.top_k,
        "repetition_penalty": chat.repetition_penalty,
    }
    defaults = getattr(model.tokenizer, "generation_defaults", {}) if model is not None else {}
    for key, value in defaults.items():
        if key in values and key not in chat.sampling_fields_set:
            values[key] = value
    if values["top_k"] is not None and values["top_k"] <= 0:  # transformers' "no top-k"
        values["top_k"] = None
    return values


def sampling_from(
    chat: ChatRequest,
    max_tokens: int,
    model: ModelHandle | None = None,
    thinking_opened: bool | None = None,
    tier_thinking_cap: int = -1,
) -> SamplingParams:
    """`thinking_opened`: None for a model that does not think in <think> tags, else whether
    the prompt opened the thinking (see thinking_budget)."""
    structured = chat.response_format
    if chat.tool_choice.mode in (ChoiceMode.REQUIRED, ChoiceMode.NAMED) and model is not None:
        fmt = detect_format(chat_template_of(model, prompt_tools(chat)), model.config.tool_parser)
        structured = forced_call_grammar(chat.tools, chat.tool_choice, fmt, chat.parallel_tool_calls)
    thinking = None
    if model is not None and thinking_opened is not None:
        thinking = thinking_budget(
            chat, model, thinking_opened, has_grammar=structured is not None, tier_cap=tier_thinking_cap
        )
    return SamplingParams(
        structured=structured,
        logprobs=chat.logprobs,
        prompt_logprobs=chat.prompt_logprobs,
        max_tokens=max_tokens,
        **_sampling_defaults(chat, model),
        seed=chat.seed,
        stop=chat.stop,
        presence_penalty=chat.presence_penalty,
        frequency_penalty=chat.frequency_penalty,
        min_tokens=min(chat.min_tokens, max_tokens),
        ignore_eos=chat.ignore_eos,
        thinking=thinking,
        logit_bias=chat.logit_bias,
    )


def thinking_budget(
    chat: ChatRequest, model: ModelHandle, opened: bool | None, *, has_grammar: bool = False, tier_cap: int = -1
) -> ThinkingBudget | None:
    """The request's thinking budget, else the model's (thinking_budget), and at most the tier's
    (max_thinking_tokens), for a model that thinks in <think> tags (`opened` is None for one
    that does not: there is nothing to cap). A relayed model's upstream gets the request's field
    instead (wire_options). Without a budget, a grammar still needs the thinking followed
    (uncapped) on the native engine: it constrains only the answer after it."""
    tokenizer = model.tokenizer
    if opened is None or not isinstance(tokenizer, Tokenizer):
        return None
    budget = chat.thinking_token_budget
    if budget is None and model.config.thinking_budget >= 0:
        budget = model.config.thinking_budget
    tags = model.thinking_tags
    if tier_cap >= 0 and tags is not None:  # else the tier cannot cap it
        budget = tier_cap if budget is None else min(budget, tier_cap)
    if budget is None:
        if tags is None or not has_grammar:
            return None
        return ThinkingBudget(None, open_id=tags[0], close_id=tags[1], forced_ids=(), opened=opened)
    if tags is None:
        if not chat.thinking_budget_strict:  # the Messages API: budget_tokens is a ceiling, not a demand
            return None
        reason = (
            "is served by TensorRT-LLM, which this server cannot make close a model's thinking"
            if model.config.backend == "trtllm"
            else "does not write <think> and </think> as single tokens, so this server cannot follow its thinking"
        )
        raise bad_request(
            f"The model `{model.name}` {reason}: a thinking budget cannot be applied to it.",
            param="thinking_token_budget",
            code="unsupported_value",
        )
    message = model.config.thinking_budget_message
    forced = (*tokenizer.encode(message), tags[1]) if message else (tags[1],)
    return ThinkingBudget(budget, open_id=tags[0], close_id=tags[1], forced_ids=forced, opened=opened)


@dataclass(frozen=True, slots=True)
class JobInputs:
    request_id: str
    principal: Principal
    tier_name: str
    tier: TierConfig
    chat: ChatRequest
    model: ModelHandle
    fallback_from: str | None
    history: tuple[ChatMessage, ...] | None  # None: not a stored conversation
    cache_salt: str | None
    fallback_reason: str | None = None


def make_job(inp: JobInputs) -> Job:
    """Tokenize and size the request; raise ApiError(400) when it cannot fit."""
    model, chat, tier = inp.model, inp.chat, inp.tier
    if chat.thinking_required and isinstance(model.tokenizer, Tokenizer) and not model.tokenizer.thinks:
        # Ollama's words; its capabilities (api/ollama_models.py) list no "thinking" for this model
        raise bad_request(f'"{model.name}" does not support thinking', param="think")
    limit = min(model.max_model_len, tier.max_context_tokens)
    where = "prompt" if chat.raw_prompt is not None else "messages"
    num_completion = min_completion_tokens(chat)
    try:
        ids, context, dropped = _encode_prompt(inp, limit, limit - num_completion)
    except PromptTooLong as exc:  # certainly past the context: refused before it was tokenized
        resolve_max_tokens(chat, tier, inp.tier_name, 0)  # a max_tokens over the tier's is refused first, as before
        raise context_too_long(
            exc.num_tokens, num_completion, limit, model.name, where, is_lower_bound=exc.is_lower_bound
        ) from None
    max_tokens = resolve_max_tokens(chat, tier, inp.tier_name, max(limit - len(ids), 0))
    check_fits(len(ids), max(max_tokens, 1), limit, model.name, where)
    now = time.monotonic()
    opened = None if chat.raw_prompt is not None else _reasoning_opened(model, prompt_tools(chat), ids)
    gen = GenerationRequest(
        request_id=inp.request_id,
        prompt_token_ids=tuple(ids),
        sampling=sampling_from(chat, max_tokens, model, opened, tier.max_thinking_tokens),
        priority=tier.priority,
        cache_salt=inp.cache_salt,
        arrival_s=now,
        chat=raw_chat_prompt(chat) if chat.raw_prompt is not None else chat_prompt(chat, context),
    )
    try:
        model.backend.check_request(gen)
    except RequestRejected as exc:
        raise ApiError(400, exc.message, "invalid_request_error", exc.code or "invalid_value", exc.param) from None
    return Job(
        request_id=inp.request_id,
        principal=inp.principal,
        tier_name=inp.tier_name,
        tier=tier,
        chat=chat,
        model=model,
        fallback_from=inp.fallback_from,
        fallback_reason=inp.fallback_reason,
        context=context,
        gen=gen,
        arrival_s=now,
        created_at=time.time(),
        history_messages_dropped=dropped,
        new_messages=tuple((m.role, m.content) for m in chat.messages),
        reasoning_opened=opened,
        usage_source=getattr(model.tokenizer, "usage_source", UsageSource.ENGINE),  # a relayed model's counter
    )


def _encode_prompt(inp: JobInputs, limit: int, max_prompt_tokens: int) -> tuple[list[int], list[ChatMessage], int]:
    """(prompt token ids, context, history messages dropped); PromptTooLong for a prompt certainly
    longer than `max_prompt_tokens`, found before it is tokenized."""
    model, chat, tier = inp.model, inp.chat, inp.tier
    if chat.raw_prompt is not None:  # a legacy completion: no template, no history
        return (*encode_raw_prompt(model, chat.raw_prompt, max_prompt_tokens), 0)
    if inp.history is not None:
        reserve = chat.max_tokens if chat.max_tokens is not None else min(tier.max_tokens, 64)
        return trim_history(
            model,
            list(inp.history),
            chat.messages,
            limit - reserve,
            prompt_tools(chat),
            chat.chat_template_kwargs,
            chat.continue_final_message,
            chat.instructions,
            max_prompt_tokens=max_prompt_tokens,
        )
    check_tool_results(chat.messages)
    context = build_context([], chat.messages, chat.instructions)
    tools, kwargs = prompt_tools(chat), chat.chat_template_kwargs
    return encode_chat(model, context, tools, kwargs, chat.continue_final_message, max_prompt_tokens), context, 0


def _reasoning_opened(model: ModelHandle, tools: tuple[Tool, ...], ids: list[int]) -> bool | None:
    """None when the prompt's template (chat_template_of) knows no <think>, else whether the prompt opened it."""
    if isinstance(model.tokenizer, Tokenizer):
        thinks = knows_thinking(chat_template_of(model, tools))
    else:  # a relayed model's counter
        thinks = getattr(model.tokenizer, "thinks", False)
    if not thinks:
        return None
    return prompt_opens_thinking(model.tokenizer.decode(ids[-8:], skip_special_tokens=False))


def conversation_not_found(conversation_id: str) -> ApiError:
    return not_found(f"No conversation found with id '{conversation_id}'.", param="conversation_id")
