"""Whether an upstream's reported usage may be billed: bounds it must fall within, set by what we
sent and what we relayed. Pure; the backend falls back to its own count when they fail.

The bounds catch broken or hostile numbers (a billion completion tokens for a two-word answer,
negative counts), not small disagreements: templates, tokenizers and stripped markup differ
between servers, so each bound leaves room for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.upstream.wire import Usage

# Tokens an upstream generates without relaying their text: the end of sequence, <think> tags its
# reasoning parser strips, a stop string that ended the answer (counted apart), per answer and
# per tool call (the <tool_call> markup and the {"name": ..., "arguments": ...} around the relayed parts).
HIDDEN_TOKENS = 16
PROMPT_MAX_FACTOR = 4  # a prompt holds at most about one token per byte; our estimate is 4 bytes a token
PROMPT_MIN_FACTOR = 8  # ... and at least one token per 32 bytes (long runs of spaces in code)
TEMPLATE_TOKENS = 256  # the upstream's chat template around the messages, beyond what we counted


@dataclass(frozen=True, slots=True)
class UsageBounds:
    """What one request sent and received, to judge the upstream's reported usage by."""

    num_prompt_tokens: int  # our own count of the prompt (tokenizer, or the 4-bytes estimate)
    max_tokens: int  # the request's limit on completion tokens
    num_output_bytes: int  # UTF-8 bytes relayed: text, reasoning, tool names and arguments
    num_tool_calls: int
    num_stop_bytes: int  # the longest stop string's (generated, not relayed)
    max_model_len: int  # the context window, 0 when unknown


def usage_problem(usage: Usage, bounds: UsageBounds) -> str | None:
    """Why `usage` cannot be billed, or None when it is plausible.

    - every count is an integer >= 0 and the cached tokens are at most the prompt's;
    - completion tokens: at most max_tokens, and at most the bytes relayed (a token is at least a
      byte of text) + the longest stop string's bytes + HIDDEN_TOKENS per answer and per tool call;
    - prompt tokens: between our count / PROMPT_MIN_FACTOR and our count x PROMPT_MAX_FACTOR +
      TEMPLATE_TOKENS, and within the context window when it is known.
    """
    if usage.problem is not None:
        return usage.problem
    prompt, cached, completion = usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
    if min(prompt, cached, completion) < 0:
        return f"negative counts (prompt {prompt}, cached {cached}, completion {completion})"
    if cached > prompt:
        return f"cached_tokens {cached} > prompt_tokens {prompt}"
    hidden = HIDDEN_TOKENS * (1 + bounds.num_tool_calls) + bounds.num_stop_bytes
    max_completion = min(bounds.max_tokens, bounds.num_output_bytes + hidden)
    if completion > max_completion:
        return f"completion_tokens {completion} > {max_completion} (max_tokens {bounds.max_tokens}, relayed bytes)"
    ours = bounds.num_prompt_tokens
    low, high = ours // PROMPT_MIN_FACTOR, ours * PROMPT_MAX_FACTOR + TEMPLATE_TOKENS
    if bounds.max_model_len:
        high = min(high, bounds.max_model_len)
    if not low <= prompt <= high:
        return f"prompt_tokens {prompt} outside {low}..{high} (our count: {ours})"
    return None
