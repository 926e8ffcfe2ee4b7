"""Which model serves a tier's request: the preferred one, or a visible fallback under load.

Pure decision logic over the configured models and tiers and the per-model queues' own
estimates; it enqueues nothing. The caller enqueues on `queues[route.model]` right after
`route()`, with no await in between, so the estimate it was routed on still holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from api.errors import ApiError, not_found, overloaded, quota_exceeded
from gateway.queue import MAX_RETRY_AFTER_S, ModelQueue
from settings import ConfigError, ModelConfig, TierConfig

log = structlog.get_logger(__name__)

MODEL_ALIASES = frozenset({"auto"})  # "let the server choose": the tier's first model


@dataclass(frozen=True, slots=True)
class Route:
    model: str  # the model that will serve (the response's `model` field)
    fallback_from: str | None = None  # the model asked for, when another one serves


class TierRouter:
    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        tiers: Mapping[str, TierConfig],
        queues: Mapping[str, ModelQueue],
    ):
        for tier_name, tier in tiers.items():
            for model in tier.models:
                if model not in models:
                    raise ConfigError(f"tiers.{tier_name}.models names undeclared model {model!r}")
        for name, model_config in models.items():
            if model_config.fallback and model_config.fallback not in models:
                raise ConfigError(f"models.{name}.fallback names undeclared model {model_config.fallback!r}")
        self._models = models
        self._tiers = tiers
        self._queues = queues

    def models_for_tier(self, tier_name: str) -> list[str]:
        """The models a tier may ask for, preferred first (for GET /v1/models)."""
        return list(self._tier(tier_name).models)

    def route(
        self,
        tier_name: str,
        requested_model: str | None,
        *,
        num_tokens: int = 0,
        over_budget: bool = False,
    ) -> Route:
        """The first candidate whose queue takes the request within the tier's wait target.

        Raises ApiError: 404 model_not_found, 403 for an unknown tier, 429 insufficient_quota
        when over budget without budget_fallback, 503 with Retry-After when all are saturated.
        """
        tier = self._tier(tier_name)
        asked = self._asked_model(tier, requested_model)
        if over_budget:
            if not tier.budget_fallback:
                raise quota_exceeded("You exceeded your current budget; check your plan and billing details.")
            candidates = [tier.models[-1]]  # the tier's cheapest model
        else:
            candidates = self._candidates(tier, asked)
        for model in candidates:
            if self._queues[model].can_take(tier.priority, num_tokens, tier.wait_target_s):
                if model != asked:
                    log.info("route_fallback", tier=tier_name, asked=asked, model=model, over_budget=over_budget)
                return Route(model, None if model == asked else asked)
        raise self._saturated(tier, candidates)

    def _tier(self, tier_name: str) -> TierConfig:
        tier = self._tiers.get(tier_name)
        if tier is None or not tier.models:
            raise ApiError(403, f"The tier {tier_name!r} is not enabled on this server.", code="tier_not_enabled")
        return tier

    def _asked_model(self, tier: TierConfig, requested_model: str | None) -> str:
        if requested_model is None or requested_model in MODEL_ALIASES:
            return tier.models[0]
        if requested_model not in self._models or requested_model not in tier.models:
            # the same answer for "unknown" and "not in your tier": no probing of other tiers
            raise not_found(
                f"The model `{requested_model}` does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            )
        return requested_model

    def _candidates(self, tier: TierConfig, asked: str) -> list[str]:
        """asked, then the tier's later models, then asked's configured fallback chain."""
        order = [asked, *tier.models[tier.models.index(asked) + 1 :]]
        fallback = self._models[asked].fallback
        while fallback and fallback not in order:
            order.append(fallback)
            fallback = self._models[fallback].fallback
        return [model for model in order if model in self._queues]  # skip models not loaded

    def _saturated(self, tier: TierConfig, candidates: list[str]) -> ApiError:
        waits_s = [self._queues[model].estimated_wait_s(tier.priority) for model in candidates]
        retry_after_s = min(max(1.0, min(waits_s, default=1.0)), MAX_RETRY_AFTER_S)
        return overloaded(
            "The server is overloaded; please retry after the time in the Retry-After header.",
            retry_after_s=retry_after_s,
        )
