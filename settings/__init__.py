"""Every setting, declared once: typed frozen dataclasses with defaults and help text.

This package re-exports the names importers use (`from settings import X`); the sections live in
serving.py, backends.py and features.py, the field machinery in fields.py, loading in loading.py.
It must not import the engine, the store or aiohttp.
"""

from settings.backends import EngineConfig, ModelConfig, TrtllmConfig, UpstreamConfig
from settings.features import (
    EmbeddingsConfig,
    FilesConfig,
    ImagesConfig,
    ModerationsConfig,
    SafetyConfig,
    SharingConfig,
    StoreConfig,
    TelemetryConfig,
)
from settings.fields import Allowed, ConfigError, setting
from settings.loading import PROJECT_DIR, Settings, load_settings, settings_help, validate
from settings.serving import ORG_LIMITS, QueueConfig, ServerConfig, TierConfig, merge_org_limits

__all__ = [
    "ORG_LIMITS",
    "PROJECT_DIR",
    "Allowed",
    "ConfigError",
    "EmbeddingsConfig",
    "EngineConfig",
    "FilesConfig",
    "ImagesConfig",
    "ModelConfig",
    "ModerationsConfig",
    "QueueConfig",
    "SafetyConfig",
    "ServerConfig",
    "Settings",
    "SharingConfig",
    "StoreConfig",
    "TelemetryConfig",
    "TierConfig",
    "TrtllmConfig",
    "UpstreamConfig",
    "load_settings",
    "merge_org_limits",
    "setting",
    "settings_help",
    "validate",
]
