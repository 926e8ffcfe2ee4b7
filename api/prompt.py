"""A request's prompt for one model: its messages rendered through the chat template and tokenized.

Owns the chat template's inputs (tools, chat_template_kwargs, a final assistant prefill),
trimming a stored conversation's oldest turns to fit, a legacy completion's raw prompt, and the
prompt relaying backends get (`ChatPrompt`). It sizes no completion and builds no `Job` (api/job.py).
"""

from __future__ import annotations

from typing import Any

import jinja2
import structlog

from api.errors import bad_request
from api.protocol import ChatMessage, ChatRequest, wire_options
from api.tools import ChoiceMode, Tool, detect_format, template_takes_tools, tools_system_prompt
from engine.registry import ModelHandle
from engine.tokenizer import PromptTooLong, TemplateRefusal, Tokenizer
from engine.types import ChatPrompt

log = structlog.get_logger(__name__)


def prompt_tools(chat: ChatRequest) -> tuple[Tool, ...]:
    return chat.tools if chat.tool_choice.mode is not ChoiceMode.NONE else ()


def chat_template_of(model: ModelHandle, tools: tuple[Tool, ...]) -> str | None:
    """The chat template text a prompt with these tools (prompt_tools) renders with: the model's
    tool_use template for one with tools, when it has one (Tokenizer.chat_template_for), else its
    template. Its tool-call format and thinking are read from it. None for a relayed model's
    counter (its upstream's template is unknown here) or a base model."""
    tokenizer = model.tokenizer
    return tokenizer.chat_template_for(has_tools=bool(tools)) if isinstance(tokenizer, Tokenizer) else None


def build_context(
    history: list[ChatMessage], new: tuple[ChatMessage, ...], first: tuple[ChatMessage, ...] = ()
) -> list[ChatMessage]:
    """The prompt's messages: `first` (a Responses request's instructions), the history, the new ones."""
    return [*first, *history, *new]


def trim_history(
    model: ModelHandle,
    history: list[ChatMessage],
    new: tuple[ChatMessage, ...],
    budget_tokens: int,
    tools: tuple[Tool, ...] = (),
    template_kwargs: dict[str, Any] | None = None,
    continue_final: bool = False,
    instructions: tuple[ChatMessage, ...] = (),
    max_prompt_tokens: int | None = None,
) -> tuple[list[int], list[ChatMessage], int]:
    """Drop the oldest non-system history turns until the prompt fits `budget_tokens`.

    Returns (prompt token ids, context, number of history messages dropped). New messages
    are never dropped; if they alone do not fit, the caller reports the overflow (PromptTooLong
    when they certainly hold more than `max_prompt_tokens`). The fewest drops that fit are found
    by bisection over the drop steps: O(log turns) encodings of the prompt, not one per dropped
    turn (a long stored conversation made that quadratic). A step that certainly does not fit is
    refused from the tokenizer's bound (engine/token_bound.py) without being tokenized, so a long
    history costs a pass of the normalizer per step tried, up to the text past the budget, and
    tokenizing what fits.
    """
    steps = _drop_steps(history)

    def attempt(k: int, max_num_tokens: int | None) -> tuple[list[int], list[ChatMessage]]:
        context = build_context(steps[k][0], new, instructions)
        return encode_chat(model, context, tools, template_kwargs, continue_final, max_num_tokens), context

    def fitting(k: int) -> tuple[list[int], list[ChatMessage]] | None:
        try:
            ids, context = attempt(k, budget_tokens)
        except PromptTooLong:
            return None
        return (ids, context) if len(ids) <= budget_tokens else None

    last = len(steps) - 1
    if last > 0 and (found := fitting(0)) is not None:
        return found[0], found[1], 0
    ids, context = attempt(last, max_prompt_tokens)
    if len(ids) > budget_tokens or last == 0:
        return ids, context, steps[last][1]  # even with every turn dropped: the caller reports it
    low, high = 0, last  # attempt(low) does not fit, attempt(high) does
    best = ids, context
    while high - low > 1:
        mid = (low + high) // 2
        if (found := fitting(mid)) is not None:
            high, best = mid, found
        else:
            low = mid
    return best[0], best[1], steps[high][1]


def _drop_steps(history: list[ChatMessage]) -> list[tuple[list[ChatMessage], int]]:
    """The history after 0, 1, 2... drops of its oldest exchange, and the messages dropped by then.
    An exchange is a non-system message and the assistant's answer that follows it; system
    messages stay."""
    kept, dropped = list(history), 0
    steps = [(list(kept), 0)]
    while droppable := [i for i, m in enumerate(kept) if m.role != "system"]:
        first = droppable[0]
        span = 2 if first + 1 < len(kept) and kept[first + 1].role == "assistant" else 1
        del kept[first : first + span]
        dropped += span
        steps.append((list(kept), dropped))
    return steps


def encode_chat(
    model: ModelHandle,
    context: list[ChatMessage],
    tools: tuple[Tool, ...] = (),
    template_kwargs: dict[str, Any] | None = None,
    continue_final: bool = False,
    max_num_tokens: int | None = None,
) -> list[int]:
    """Render through the chat template; tools go in as `tools=` (or a system message, for a
    template that ignores them); `template_kwargs` (a request's chat_template_kwargs) as template
    variables. A template that refuses the messages (its raise_exception) or fails on them or on
    the kwargs is the client's error: a 400 naming which, with the template's words. `continue_final`: the
    last message is an assistant's prefill the answer continues (the prompt ends with its text).
    `max_num_tokens`: PromptTooLong, before tokenizing, for a prompt certainly longer (a model
    served here; a relayed model's counter counts in full)."""
    if not model.serves_chat:
        raise bad_request(
            f"The model '{model.name}' has no chat template (a base model): it serves text completions only, "
            "POST /v1/completions with a 'prompt' (Ollama's API: /api/generate with \"raw\": true).",
            param="model",
            code="model_not_chat",
        )
    if continue_final and model.config.backend == "openai":
        raise bad_request(
            f"The model '{model.name}' is relayed to another server: continuing a final assistant message "
            "(a prefill) is not supported for it.",
            param="messages",
        )
    options: dict[str, Any] = {"continue_final_message": True} if continue_final else {}
    if max_num_tokens is not None and isinstance(model.tokenizer, Tokenizer):
        options["max_num_tokens"] = max_num_tokens
    try:
        return _encode_chat(model, context, tools, {**(template_kwargs or {}), **options})
    except TemplateRefusal as exc:  # the template's raise_exception: these messages are not its shape
        raise bad_request(
            f"The chat template of '{model.name}' refuses these messages: {exc}", param="messages"
        ) from None
    except _RENDER_ERRORS as exc:
        raise _render_failed(model, context, tools, options, template_kwargs, exc) from None


# What rendering a chat template raises on input it was not written for (beside TemplateRefusal):
# an undefined variable, a wrong type, the sandbox's range limit.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, OverflowError)


def _render_failed(
    model: ModelHandle,
    context: list[ChatMessage],
    tools: tuple[Tool, ...],
    options: dict[str, Any],
    template_kwargs: dict[str, Any] | None,
    exc: Exception,
) -> Exception:
    """The 400 for a template that failed: blamed on chat_template_kwargs when the messages
    render without them, else on the messages (and logged: the template may be at fault)."""
    if template_kwargs:
        try:
            _encode_chat(model, context, tools, options)
        except Exception:  # it fails without them too: the messages are at fault
            pass
        else:
            return bad_request(
                f"The chat template failed with these chat_template_kwargs: {exc}", param="chat_template_kwargs"
            )
    log.warning("chat_template_failed", model=model.name, error=f"{type(exc).__name__}: {exc}"[:300])
    return bad_request(f"The chat template of '{model.name}' cannot render these messages: {exc}", param="messages")


def _encode_chat(model: ModelHandle, context: list[ChatMessage], tools: tuple[Tool, ...], kwargs: dict) -> list[int]:
    messages = [m.as_template_dict() for m in context]
    if not tools:
        return _render(model, messages, kwargs)
    with_tools = {"tools": [t.as_template_arg() for t in tools], **kwargs}
    template = chat_template_of(model, tools)  # None: an upstream model's token counter
    if template is None or template_takes_tools(template):
        return _render(model, messages, with_tools)
    fmt = detect_format(template, model.config.tool_parser)
    prompt = {"role": "system", "content": tools_system_prompt(tools, fmt)}
    if messages and messages[0]["role"] == "system":
        prompt["content"] = messages[0]["content"] + "\n\n" + prompt["content"]
        messages = messages[1:]
    # `tools=` still: it picks the template chosen above, which reads none of it
    return _render(model, [prompt, *messages], with_tools)


def _render(model: ModelHandle, messages: list[dict[str, Any]], kwargs: dict) -> list[int]:
    """encode_chat; a template that refuses the system role (Gemma 2's "System role not
    supported") gets the leading system text at the head of the first user turn instead, as
    Gemma 3's own template does with it."""
    try:
        return model.tokenizer.encode_chat(messages, **kwargs)
    except TemplateRefusal:
        folded = _system_folded(messages)
        if folded is None:
            raise
        ids = model.tokenizer.encode_chat(folded, **kwargs)
        if model.name not in _FOLDS_LOGGED:
            _FOLDS_LOGGED.add(model.name)
            log.info("chat_template_system_folded", model=model.name)
        return ids


_FOLDS_LOGGED: set[str] = set()  # models whose fold was logged (once each)


def _system_folded(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The leading system messages' text joined to the first user message's; None when there is
    no leading system text or no user message right after it to carry it."""
    num_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    rest = messages[num_system:]
    texts = [m["content"] for m in messages[:num_system]]
    if not num_system or not rest or rest[0]["role"] != "user":
        return None
    if not all(isinstance(t, str) for t in [*texts, rest[0]["content"]]):
        return None
    joined = "\n\n".join(t for t in [*texts, rest[0]["content"]] if t)
    return [{**rest[0], "content": joined}, *rest[1:]]


def encode_raw_prompt(
    model: ModelHandle, prompt: str | tuple[int, ...], max_num_tokens: int | None = None
) -> tuple[list[int], list[ChatMessage]]:
    """A legacy completion's prompt (POST /v1/completions): its token ids as the model reads them
    (no chat template), and its text as one user message for the safety gate. Token ids are
    checked against the vocabulary; a relayed model (backend "openai") takes text only, counted
    with its token counter. PromptTooLong for a prompt certainly longer than `max_num_tokens`:
    more ids than that are refused before any is checked or decoded."""
    tokenizer = model.tokenizer
    if not isinstance(tokenizer, Tokenizer):
        if not isinstance(prompt, str):
            raise bad_request(
                f"The model `{model.name}` is relayed to another server: send the prompt as text, not token ids.",
                param="prompt",
                code="unsupported_value",
            )
        ids, text = tokenizer.encode(prompt), prompt
    elif isinstance(prompt, str):
        ids, text = tokenizer.encode_prompt(prompt, max_num_tokens=max_num_tokens), prompt
    elif max_num_tokens is not None and len(prompt) > max_num_tokens:
        raise PromptTooLong(len(prompt), is_lower_bound=False)  # ids: counted, not bounded
    else:
        outside = next((t for t in prompt if not 0 <= t < tokenizer.vocab_size), None)
        if outside is not None:
            raise bad_request(
                f"'prompt' holds the token id {outside}, outside this model's vocabulary "
                f"(0 to {tokenizer.vocab_size - 1}).",
                param="prompt",
            )
        ids, text = list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)
    if not ids:
        raise bad_request("'prompt' is empty (and this model's tokenizer adds no start token).", param="prompt")
    return ids, [ChatMessage("user", text)]


def chat_prompt(chat: ChatRequest, context: list[ChatMessage]) -> ChatPrompt:
    """The context as OpenAI message objects (the text the template sees), plus the validated
    fields beyond sampling (tools, response_format, logprobs, n) in OpenAI's wire shape."""
    messages = tuple(m.as_wire_dict() for m in context)
    return ChatPrompt(messages, wire_options(chat))


def raw_chat_prompt(chat: ChatRequest) -> ChatPrompt | None:
    """A legacy completion's text prompt for backends that relay it (its response_format the
    one option that applies); None for token ids, which only models served here take."""
    if not isinstance(chat.raw_prompt, str):
        return None
    options = {k: v for k, v in wire_options(chat).items() if k == "response_format"}
    return ChatPrompt((), options, prompt=chat.raw_prompt)
