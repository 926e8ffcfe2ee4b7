"""A model's tokenizer and chat template, loaded from a Hugging Face-layout folder.

Owns `tokenizer.json` (via the `tokenizers` library), the chat template (rendered with
jinja2 the way transformers' `apply_chat_template` renders it) and the EOS ids. It accepts
both layouts users bring: the template inside `tokenizer_config.json` or in
`chat_template.jinja`, named templates among them (one chosen by name, else "default", and
"tool_use" for chats with tools as transformers picks it); EOS ids from `generation_config.json`,
`config.json` and the tokenizer; the default temperature / top_p / top_k / repetition_penalty from
`generation_config.json`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Self

import jinja2
import structlog
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.token_bound import TokenBound

log = structlog.get_logger(__name__)


class TokenizerLoadError(Exception):
    """A missing or malformed tokenizer file, named in the message."""


class TemplateRefusal(jinja2.exceptions.TemplateError):
    """The chat template's own `raise_exception(...)`: it refuses these messages (a role it does
    not take, such as Gemma 2's "System role not supported", or roles that do not alternate)."""


class PromptTooLong(Exception):
    """A prompt certainly longer than the tokens it was allowed: `num_tokens`, more than that
    limit, is a lower bound on its length (it was not tokenized), or its exact length where
    `is_lower_bound` is False (token ids, counted)."""

    def __init__(self, num_tokens: int, *, is_lower_bound: bool = True):
        super().__init__(f"the prompt holds {'at least ' if is_lower_bound else ''}{num_tokens} tokens")
        self.num_tokens = num_tokens
        self.is_lower_bound = is_lower_bound


@dataclass(frozen=True, slots=True)
class ChatTemplates:
    """The templates a model renders chats with: `default` (None: a base model), and `tool_use`
    for chats with tools when the folder has one so named and chat_template_name chose none, as
    transformers' apply_chat_template picks it for a call with tools."""

    default: str | None
    tool_use: str | None = None


def knows_thinking(template: str | None) -> bool:
    """Whether a chat template knows <think>...</think> reasoning (Qwen3, R1 distills, ...)."""
    return template is not None and "</think>" in template


def _non_blank(template: str | None) -> str | None:
    return template if template and template.strip() else None


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        raise TokenizerLoadError(f"{path}: cannot parse JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """Special tokens are written either as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def _raise_exception(message: str) -> None:
    raise TemplateRefusal(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _compile_template(source: str) -> jinja2.Template:
    # Same environment options as transformers' chat-template renderer.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerLoadError(f"chat template does not compile: {exc}") from None


class Tokenizer:
    """Encode, decode and render chats for one model."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_templates: ChatTemplates,
        special_tokens: dict[str, str | None],
        eos_token_ids: tuple[int, ...],
        generation_defaults: dict[str, float | int] | None = None,
    ):
        self._tok = tokenizer
        # A second tokenizer whose special-token text is plain text, for message content: a flag
        # switched on the shared one would race between the event loop and a worker thread.
        self._literal_tok = HFTokenizer.from_str(tokenizer.to_str())
        self._literal_tok.encode_special_tokens = True
        self._bound = TokenBound.of(tokenizer)  # None: prompts are only counted exactly
        self.generation_defaults = generation_defaults or {}  # from generation_config.json
        self.chat_template = _non_blank(chat_templates.default)  # None ("" too): a base model
        self.tool_use_template = _non_blank(chat_templates.tool_use)  # None: chat_template renders tools too
        self._compiled = {t: _compile_template(t) for t in (self.chat_template, self.tool_use_template) if t}
        self.bos_token = special_tokens.get("bos_token")
        self.eos_token = special_tokens.get("eos_token")
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._special_texts = tuple(
            t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content
        )
        tag_ids = [self.encode(tag) for tag in ("<think>", "</think>")]
        single = self.thinks and all(len(ids) == 1 for ids in tag_ids)
        self._thinking_tag_ids = (tag_ids[0][0], tag_ids[1][0]) if single else None

    @classmethod
    def from_dir(cls, path: Path | str, *, chat_template_name: str = "") -> Self:
        """The folder's tokenizer, rendering chats with its chat template called `chat_template_name`
        (models.<name>.chat_template_name), else the one called "default" (and those with tools
        with the one called "tool_use", if any)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise TokenizerLoadError(f"{tok_file}: missing (a tokenizer.json is required)")
        try:
            tokenizer = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise TokenizerLoadError(f"{tok_file}: cannot load: {exc}") from None
        tok_cfg = _read_json(path / "tokenizer_config.json") or {}
        templates = _chat_templates(path, tok_cfg, chat_template_name)
        special = {k: _token_text(tok_cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        eos_ids = _eos_ids(path, tokenizer, special["eos_token"])
        return cls(tokenizer, templates, special, eos_ids, _generation_defaults(path))

    def chat_template_for(self, *, has_tools: bool) -> str | None:
        """The template text a chat renders with: the tool_use one for a chat with tools (passed
        as `tools=`) when the model has one, else chat_template. Everything that reads the template
        of a request (its tool-call format, its thinking) reads this one."""
        if has_tools and self.tool_use_template is not None:
            return self.tool_use_template
        return self.chat_template

    @property
    def thinks(self) -> bool:
        """Whether any chat template of this model knows <think> reasoning (whether a request's
        does: `knows_thinking(chat_template_for(...))`)."""
        return any(knows_thinking(t) for t in self._compiled)

    def thinking_tag_ids(self) -> tuple[int, int] | None:
        """The ids of <think> and </think> when each is one token of this vocabulary (as in Qwen3,
        the R1 distills, SmolLM3: what a thinking budget needs to follow the model); else None."""
        return self._thinking_tag_ids

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        max_num_tokens: int | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Render and tokenize a chat so that message text can never become control tokens.

        `template_kwargs` are extra template variables (a request's chat_template_kwargs, such
        as enable_thinking), as transformers' apply_chat_template passes them.
        `continue_final_message`: the last message (an assistant's prefill) is left open, the
        prompt ending with its text, so the model continues it (transformers' option of that name).
        `max_num_tokens`: a prompt certainly longer raises PromptTooLong before it is tokenized
        (engine/token_bound.py), so a prompt far past the context costs a pass of the normalizer,
        not its tokenization; one that may fit is tokenized exactly.

        Text such as "<|im_end|>" typed by a user is tokenized as plain text (the injection
        of transformers#29279). Chats without such text take the plain path, which is
        token-for-token what transformers produces.
        """
        pieces = self._chat_pieces(messages, add_generation_prompt, tools, continue_final_message, template_kwargs)
        if max_num_tokens is not None:
            self._check_length(pieces, max_num_tokens)
        ids: list[int] = []
        for text, is_literal in pieces:
            ids += self._encode_literal(text) if is_literal else self.encode(text)
        return ids

    def _chat_pieces(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict] | None,
        continue_final_message: bool,
        template_kwargs: dict[str, Any],
    ) -> list[tuple[str, bool]]:
        """The rendered chat as (text, is_literal) pieces, tokenized apart and joined in order;
        a literal piece is message text whose special-token text stays plain text."""
        has_special = any(tok in str(m.get("content", "")) for m in messages for tok in self._special_texts)
        if not has_special and not continue_final_message:
            rendered = self.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
            )
            return [(rendered, False)]
        sentinels = [f"\x00{i}\x00" for i in range(len(messages))]
        rendered = self.apply_chat_template(
            [{**m, "content": s} for m, s in zip(messages, sentinels, strict=True)],
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            tools=tools,
            **template_kwargs,
        )
        if continue_final_message:  # the prompt ends where the last message's text ends
            end = rendered.rfind(sentinels[-1])
            if end < 0:
                raise TokenizerLoadError("the chat template does not render the final message's text")
            rendered = rendered[: end + len(sentinels[-1])]
            if not has_special:  # one piece of text, tokenized whole as transformers does
                for sentinel, m in zip(sentinels, messages, strict=True):
                    rendered = rendered.replace(sentinel, str(m.get("content", "")), 1)
                return [(rendered, False)]
        pieces: list[tuple[str, bool]] = []
        for i, sentinel in enumerate(sentinels):
            head, _, rendered = rendered.partition(sentinel)
            pieces += [(head, False), (str(messages[i].get("content", "")), True)]
        return pieces if continue_final_message else [*pieces, (rendered, False)]

    def _check_length(self, pieces: list[tuple[str, bool]], max_num_tokens: int) -> None:
        """PromptTooLong if the pieces certainly hold more than `max_num_tokens` tokens. Pieces of
        at most max_num_tokens x max_token_chars characters in all are not bounded: unless the
        normalizer lengthens text, their bound is within the limit (and they cost little to tokenize)."""
        bound = self._bound
        if bound is None or sum(len(text) for text, _ in pieces) <= max_num_tokens * bound.max_token_chars:
            return
        num_tokens = 0
        for text, is_literal in pieces:
            tok = self._literal_tok if is_literal else self._tok
            num_tokens += bound.min_num_tokens(tok, text, is_literal=is_literal, stop_above=max_num_tokens - num_tokens)
            if num_tokens > max_num_tokens:
                raise PromptTooLong(num_tokens)

    def _encode_literal(self, text: str) -> list[int]:
        return _encode(self._literal_tok, text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        # Rendered chat text already holds its special tokens: add none.
        return _encode(self._tok, text, add_special_tokens=False)

    def encode_prompt(self, text: str, *, max_num_tokens: int | None = None) -> list[int]:
        """A raw prompt (a legacy completion's) as the model reads it without a chat template: with
        the special tokens the tokenizer's post-processor adds (a BOS for Llama or Gemma, none for
        Qwen), as transformers' `tokenizer(text)` does; special-token text in it stays special.
        `max_num_tokens`: as encode_chat's (the added BOS only makes the prompt longer)."""
        if max_num_tokens is not None:
            self._check_length([(text, False)], max_num_tokens)
        return _encode(self._tok, text, add_special_tokens=True)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat rendered through chat_template_for: given `tools` (an empty list too, as
        transformers), the tool_use template."""
        template = self.chat_template_for(has_tools=tools is not None)
        if template is None:
            raise TokenizerLoadError("this model has no chat template")
        return self._compiled[template].render(
            **template_kwargs,
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _chat_templates(path: Path, tok_cfg: dict[str, Any], name: str) -> ChatTemplates:
    """The templates chats are rendered with: the one called `name` (the model's chat_template_name)
    for every chat, else the one called "default" (None: a base model) and the one called
    "tool_use" for chats with tools. A folder whose templates have none called "default" is refused
    naming them, as transformers refuses it ("multiple chat templates with no default specified")
    for a chat without tools, rather than one of them used unasked."""
    templates = _named_templates(path, tok_cfg)
    names = ", ".join(repr(n) for n in templates)
    if name:
        if name not in templates:
            have = f"its chat templates are {names}" if templates else "it has no chat template"
            raise TokenizerLoadError(f"{path}: chat_template_name is {name!r}, but {have}")
        return ChatTemplates(templates[name])
    if templates and "default" not in templates:
        raise TokenizerLoadError(
            f"{path}: its chat templates are named {names}, none of them 'default': choose the one to serve "
            "with the model's chat_template_name setting"
        )
    return ChatTemplates(templates.get("default"), templates.get("tool_use"))


def _named_templates(path: Path, tok_cfg: dict[str, Any]) -> dict[str, str]:
    """The folder's chat templates by name, a lone one called "default". transformers' files come
    first (chat_template.jinja, the default, and additional_chat_templates/<name>.jinja), then
    tokenizer_config.json's chat_template (a string, or a list of {"name", "template"}), then
    chat_template.json's."""
    files = {"default": path / "chat_template.jinja"} if (path / "chat_template.jinja").exists() else {}
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        files |= {f.name.removesuffix(".jinja"): f for f in sorted(extra_dir.glob("*.jinja"))}
    if files:
        return {name: _read_template(file) for name, file in files.items()}
    template = tok_cfg.get("chat_template")
    legacy = _read_json(path / "chat_template.json")
    if template is None and legacy is not None:
        template = legacy.get("chat_template")
    if template is None:
        return {}
    # A list: [{"name": "default", "template": ...}, {"name": "tool_use", "template": ...}]
    entries = template if isinstance(template, list) else [{"name": "default", "template": template}]
    named: dict[str, str] = {}
    for entry in (e for e in entries if isinstance(e, dict)):
        name, text = entry.get("name"), entry.get("template")
        if not isinstance(name, str) or not isinstance(text, str):
            raise TokenizerLoadError(f"{path / 'tokenizer_config.json'}: chat_template is not a string")
        named[name] = text
    return named


def _read_template(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise TokenizerLoadError(f"{file}: cannot read: {exc}") from None


# Sampling defaults a checkpoint's generation_config.json may set, applied (as vLLM does) to a
# request that leaves them unset; name -> the type each must have. `do_sample` is not read (nor
# by vLLM): a request's temperature 0 is greedy.
GENERATION_DEFAULT_KEYS = {"temperature": float, "top_p": float, "top_k": int, "repetition_penalty": float}
# The values a request may send (api/protocol.py): a default outside them is not applied.
_GENERATION_DEFAULT_OK = {
    "temperature": lambda v: 0 <= v <= 2,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= -1 and v == int(v),
    "repetition_penalty": lambda v: v > 0,
}


def _generation_defaults(path: Path) -> dict[str, float | int]:
    cfg = _read_json(path / "generation_config.json") or {}
    defaults: dict[str, float | int] = {}
    for key, kind in GENERATION_DEFAULT_KEYS.items():
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            ok = False
        else:
            ok = _GENERATION_DEFAULT_OK[key](value)
        if not ok:  # e.g. a negative temperature would invert sampling: serve without it, and say so
            log.warning("generation_default_ignored", file=str(path / "generation_config.json"), key=key, value=value)
            continue
        defaults[key] = kind(value)
    return defaults


def _eos_ids(path: Path, tokenizer: HFTokenizer, eos_token: str | None) -> tuple[int, ...]:
    """Every EOS id the checkpoint names (Gemma 3 and Llama 3 list several), in one tuple."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(path / name) or {}
        ids += [i for i in _as_id_list(cfg.get("eos_token_id")) if i not in ids]
    if eos_token is not None:
        tid = tokenizer.token_to_id(eos_token)
        if tid is not None and tid not in ids:
            ids.append(tid)
    return tuple(ids)


GIL_FREE_CHARS = 8192  # longer texts are encoded through encode_batch, which releases the GIL


def _encode(tok: HFTokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    """`tok.encode(text).ids`; a long text through `encode_batch` (the same ids), which lets
    the event loop run while a worker thread tokenizes (`encode` holds the GIL throughout)."""
    if len(text) < GIL_FREE_CHARS:
        return tok.encode(text, add_special_tokens=add_special_tokens).ids
    return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
