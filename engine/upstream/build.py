"""Builds an upstream model from its config: the optional local tokenizer, then the backend."""

from __future__ import annotations

import json
from pathlib import Path

from engine.tokenizer import Tokenizer, TokenizerLoadError
from engine.upstream.backend import UpstreamBackend
from engine.upstream.counting import Counter, EstimatingCounter, TokenizerCounter
from settings import ConfigError, ModelConfig, UpstreamConfig


def build_upstream_model(name: str, config: ModelConfig, upstream: UpstreamConfig) -> tuple[UpstreamBackend, Counter]:
    if config.path:
        raise ConfigError(
            f"models.{name}.path: a model with backend 'openai' has no local weights; "
            "use 'tokenizer' for a local tokenizer folder"
        )
    if config.tool_parser not in ("auto", "hermes"):
        raise ConfigError(
            f"models.{name}.tool_parser: an upstream model's tool calls are relayed in the hermes "
            f"form; leave it 'auto' (got {config.tool_parser!r})"
        )
    counter: Counter = EstimatingCounter()
    max_len = config.max_model_len or None
    if config.tokenizer:
        folder = Path(config.tokenizer)
        if not folder.is_dir():
            raise ConfigError(f"models.{name}.tokenizer: folder not found: {folder}")
        try:
            tokenizer = Tokenizer.from_dir(folder, chat_template_name=config.chat_template_name)
        except TokenizerLoadError as exc:
            raise ConfigError(f"models.{name}.tokenizer: {exc}") from None
        if tokenizer.chat_template is None:
            raise ConfigError(f"models.{name}.tokenizer: {folder} has no chat template")
        counter = TokenizerCounter(tokenizer)
        max_len = max_len or _max_position_embeddings(folder)
    return UpstreamBackend(name, config, upstream, counter, max_model_len=max_len), counter


def _max_position_embeddings(folder: Path) -> int | None:
    try:
        value = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, int) else None
