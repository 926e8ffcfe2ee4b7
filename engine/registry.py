"""Builds the configured models: one backend and one tokenizer per model name.

Owns the choice of backend class from `ModelConfig.backend` and imports optional backends
(TensorRT-LLM) only when configured. It does not route, queue or validate requests. Tests pass a
`BackendFactory` to serve the native models with a stand-in (testing/fake_backend.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from engine.tokenizer import Tokenizer, TokenizerLoadError
from engine.types import Backend
from settings import ConfigError, ModelConfig, Settings

if TYPE_CHECKING:
    from engine.upstream.counting import Counter

log = structlog.get_logger(__name__)

BACKENDS = ("native", "trtllm", "openai")
TOOL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")  # api/tools.py ToolFormat

# (name, tokenizer, max_model_len or None) -> a stand-in for a model configured with backend =
# "native", or None to build the native engine for it.
BackendFactory = Callable[[str, Tokenizer, int | None], Backend | None]


@dataclass(slots=True)
class ModelHandle:
    name: str
    config: ModelConfig
    backend: Backend
    tokenizer: Tokenizer | Counter  # backend "openai": the counter of engine/upstream/counting.py

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len

    @property
    def serves_chat(self) -> bool:
        """False for a local model without a chat template (a base model): /v1/completions only."""
        return not isinstance(self.tokenizer, Tokenizer) or self.tokenizer.chat_template is not None

    @property
    def thinking_tags(self) -> tuple[int, int] | None:
        """(<think>, </think>) ids when this server can follow and cap the model's thinking: the
        native engine, each tag one token; else None."""
        if self.config.backend != "native" or not isinstance(self.tokenizer, Tokenizer):
            return None
        return self.tokenizer.thinking_tag_ids()


def _config_max_len(model_dir: Path, configured: int) -> int | None:
    """The context to serve: models.<name>.max_model_len, else config.json's max_position_embeddings;
    None when it gives none usable (the native engine's preflight names what is wrong)."""
    if configured > 0:
        return configured
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{cfg_file}: cannot parse JSON: {exc}") from None
    value = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def build_model(
    name: str, config: ModelConfig, settings: Settings, backend_factory: BackendFactory | None = None
) -> ModelHandle:
    """Construct (not start) the backend for one model; raises ConfigError on bad setup."""
    if config.backend not in BACKENDS:
        raise ConfigError(f"models.{name}.backend: expected one of {', '.join(BACKENDS)}, got {config.backend!r}")
    if config.tool_parser not in TOOL_PARSERS:
        raise ConfigError(
            f"models.{name}.tool_parser: expected one of {', '.join(TOOL_PARSERS)}, got {config.tool_parser!r}"
        )
    if config.thinking_budget < -1:
        raise ConfigError(
            f"models.{name}.thinking_budget: expected -1 (no limit) or more, got {config.thinking_budget}"
        )
    if config.thinking_budget >= 0 and config.backend != "native":
        raise ConfigError(
            f"models.{name}.thinking_budget: only the native engine caps thinking (an upstream server takes a "
            "request's thinking_token_budget as it is; set its own default there)"
        )
    if config.idle_unload_s < 0 or (config.idle_unload_s > 0 and config.backend != "native"):
        raise ConfigError(
            f"models.{name}.idle_unload_s: expected 0 (always loaded) or more seconds, for a native model only; "
            f"got {config.idle_unload_s} for backend {config.backend!r}"
        )
    if config.backend == "openai":
        from engine.upstream.build import build_upstream_model

        upstream, counter = build_upstream_model(name, config, settings.upstream)
        return ModelHandle(name, config, upstream, counter)
    model_dir = Path(config.path)
    if not model_dir.is_dir():
        raise ConfigError(f"models.{name}.path: model folder not found: {model_dir}")
    max_len = _config_max_len(model_dir, config.max_model_len)  # first: a config.json not UTF-8 is named
    try:
        tokenizer = Tokenizer.from_dir(model_dir, chat_template_name=config.chat_template_name)
    except TokenizerLoadError as exc:
        raise ConfigError(f"models.{name}: {exc}") from None
    if tokenizer.chat_template is None:  # a base model: text completions only
        log.warning(
            "model_without_chat_template",
            model=name,
            detail="served on /v1/completions only (no chat_template in tokenizer_config.json or chat_template.jinja)",
        )
    if not tokenizer.eos_token_ids:  # nothing ends an answer but its max_tokens
        log.warning(
            "model_without_eos_token",
            model=name,
            model_dir=str(model_dir),
            detail="no eos_token_id in generation_config.json or config.json, and no eos_token in "
            "tokenizer_config.json that tokenizer.json holds: every answer runs to max_tokens",
        )
    if config.thinking_budget >= 0 and tokenizer.thinking_tag_ids() is None:
        raise ConfigError(
            f"models.{name}.thinking_budget: {model_dir} does not think in <think> tags written as single tokens"
        )
    stand_in = backend_factory(name, tokenizer, max_len) if backend_factory and config.backend == "native" else None
    backend: Backend
    if stand_in is not None:
        backend = stand_in
    elif config.backend == "native":
        from engine.native.backend import NativeBackend
        from engine.native.loader import ModelLoadError, preflight
        from engine.native.on_demand import OnDemandBackend
        from engine.native.vision import is_llava

        try:
            # before any model loads: a broken folder is one line, not a traceback
            preflight(model_dir, max_model_len=config.max_model_len)
        except ModelLoadError as exc:
            raise ConfigError(f"models.{name}: {exc}") from None

        def native(tokenizer: Tokenizer = tokenizer) -> NativeBackend:
            return NativeBackend(
                model_dir,
                settings.engine,
                tokenizer,
                max_model_len=max_len,
                prefix_cache_dir=_prefix_cache_dir(settings),
            )

        if config.idle_unload_s > 0:  # loaded on its first request, unloaded when idle
            backend = OnDemandBackend(native, idle_unload_s=config.idle_unload_s, name=name)
        else:
            backend = native()
        if is_llava(model_dir):  # a vision model: the API places images through its tokenizer
            from engine.native.image_prompt import ImageTokenizer

            tokenizer = ImageTokenizer.for_model(model_dir, chat_template_name=config.chat_template_name)
            if isinstance(backend, OnDemandBackend):  # unloaded, it keeps no prepared images either
                backend.on_unload = tokenizer.image_prompter.prepared.clear
    else:
        from engine.trtllm.backend import TrtllmBackend  # optional extra: import only when configured

        backend = TrtllmBackend(model_dir, settings.trtllm, tokenizer, max_model_len=max_len)
    return ModelHandle(name, config, backend, tokenizer)


def _prefix_cache_dir(settings: Settings) -> Path | None:
    """engine.prefix_cache_dir resolved: "auto" is a folder beside the database."""
    configured = settings.engine.prefix_cache_dir
    if configured == "auto":
        return Path(settings.store.path).parent / "prefix-cache"
    return Path(configured) if configured else None


def build_models(settings: Settings, backend_factory: BackendFactory | None = None) -> dict[str, ModelHandle]:
    if not settings.models:
        raise ConfigError("no models configured: add a [models.<name>] section or pass --model DIR")
    return {name: build_model(name, cfg, settings, backend_factory) for name, cfg in settings.models.items()}
