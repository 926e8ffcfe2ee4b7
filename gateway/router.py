"""Which model serves a tier's request: the preferred one, or a visible fallback under load.

Pure decision logic over the configured models and tiers and the per-model queues' own
assessments; it enqueues nothing. Knows no HTTP: refusals are `gateway.errors` types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import structlog

from gateway.errors import (
    GatewayError,
    NotEnabled,
    NotFound,
    Overloaded,
    OverQuota,
    Reason,
)
from gateway.queue import ModelQueue, refusal
from gateway.waiting_room import Offer, Outcome, Placement
from settings import ConfigError, ModelConfig, TierConfig

log = structlog.get_logger(__name__)

MODEL_ALIASES = frozenset({"auto"})  # "let the server choose": the tier's first model


@dataclass(frozen=True, slots=True)
class Route:
    model: str  # the model that will serve (the response's `model` field)
    fallback_from: str | None = None  # the model asked for, when another one serves
    # why: "busy" (past the wait target), "unavailable" (cannot be reached) or "over_budget"
    fallback_reason: str | None = None


def check_model_names(models: Mapping[str, ModelConfig], tiers: Mapping[str, TierConfig]) -> None:
    """A ConfigError for a tier or a fallback naming a model that is not declared."""
    for tier_name, tier in tiers.items():
        for model in tier.models:
            if model not in models:
                raise ConfigError(f"tiers.{tier_name}.models names undeclared model {model!r}")
    for name, model_config in models.items():
        if model_config.fallback and model_config.fallback not in models:
            raise ConfigError(f"models.{name}.fallback names undeclared model {model_config.fallback!r}")


class TierRouter:
    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        tiers: Mapping[str, TierConfig],
        queues: Mapping[str, ModelQueue],
    ):
        check_model_names(models, tiers)
        self._models = models
        self._tiers = tiers
        self._queues = queues
        self._top_priority = max((t.priority for t in tiers.values() if t.models), default=0)

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
        arrival_s: float | None = None,
    ) -> Route:
        """The first candidate whose queue takes the request within the tier's wait target.

        The top tier is never refused for waiting: when every candidate is past its target it
        goes to the first that still has a place for it. `arrival_s`: a retry's carried
        arrival (see `Offer.arrival_s`). Raises NotFound, NotEnabled,
        OverQuota (over budget without budget_fallback), or Overloaded from the first
        candidate when none takes the request.
        """
        tier = self._tier(tier_name)
        asked = self._asked_model(tier, requested_model)
        if over_budget:
            if not tier.budget_fallback:
                raise OverQuota("You exceeded your current budget; check your plan and billing details.")
            candidates = [tier.models[-1]]  # the tier's cheapest model
        else:
            candidates = self._candidates(tier, asked)
        placements: dict[str, Placement] = {}
        taker = self._first_taker(
            tier_name, tier, candidates, Offer("", tier.priority, num_tokens, arrival_s=arrival_s), placements
        )
        if taker == asked:
            return Route(taker)
        log.info("route_fallback", tier=tier_name, asked=asked, model=taker, over_budget=over_budget)
        if over_budget:
            return Route(taker, asked, "over_budget")
        unreachable = asked not in placements or placements[asked].reason is Reason.MODEL_UNAVAILABLE
        return Route(taker, asked, "unavailable" if unreachable else "busy")

    def precheck(self, tier_name: str, *, arrival_s: float | None = None) -> None:
        """Raises Overloaded when no model the tier may ask for would take a request now, so
        that a flood is refused before its body is read; `route` then decides for the model asked.

        Any other refusal (tier not enabled, no model loaded) is left to `route`, which reports it
        with the model asked.
        """
        tier = self._tiers.get(tier_name)
        if tier is None:
            return
        first: Overloaded | None = None
        for asked in tier.models:
            try:
                self._first_taker(
                    tier_name, tier, self._candidates(tier, asked), Offer("", tier.priority, 0, arrival_s=arrival_s)
                )
                return
            except Overloaded as exc:
                first = first or exc
            except GatewayError:
                return
        if first is not None:
            raise first

    def _first_taker(
        self,
        tier_name: str,
        tier: TierConfig,
        candidates: list[str],
        offer: Offer,
        placements: dict[str, Placement] | None = None,
    ) -> str:
        """The first candidate whose queue takes `offer` (its wait limit set per model) within
        the tier's target; else the soonest refusal. `placements` gets each candidate's assessment."""
        placements = {} if placements is None else placements
        for model in candidates:
            target = replace(offer, wait_limit_s=self._target_s(tier_name, tier, model))
            placements[model] = self._queues[model].assess(target)
            if placements[model].outcome is not Outcome.REFUSED:
                return model
        if self._is_top(tier):
            for model in candidates:
                target = replace(offer, wait_limit_s=self._max_wait_s(model))
                placements[model] = self._queues[model].assess(target)  # the refusal to report
                if placements[model].outcome is not Outcome.REFUSED:
                    return model
        if not placements:
            raise NotEnabled(Reason.TIER_NOT_ENABLED, f"No model of the tier {tier_name!r} is loaded.")
        soonest = min(placements.values(), key=lambda p: p.retry_after_s)
        raise refusal(soonest)

    def wait_limit_s(self, tier_name: str, model: str) -> float:
        """The estimated wait above which a request of this tier is shed from `model`'s queue.

        The top tier has none but the queue's max_wait_s. Any other tier uses the smallest
        wait target among itself and the tiers above it (the top one aside): a lower tier,
        which always waits at least as long, is then shed whenever a higher one is.
        """
        tier = self._tier(tier_name)
        limit_s = self._max_wait_s(model)
        if self._is_top(tier):
            return limit_s
        targets = [
            t.wait_target_s
            for t in self._tiers.values()
            if t.models and tier.priority <= t.priority < self._top_priority
        ]
        return min([limit_s, *targets])

    def _target_s(self, tier_name: str, tier: TierConfig, model: str) -> float:
        """Where a fallback is taken: the tier's own target (the top tier's too)."""
        return min(tier.wait_target_s, self.wait_limit_s(tier_name, model))

    def _is_top(self, tier: TierConfig) -> bool:
        return tier.priority >= self._top_priority

    def _max_wait_s(self, model: str) -> float:
        return self._queues[model].config.max_wait_s

    def _tier(self, tier_name: str) -> TierConfig:
        tier = self._tiers.get(tier_name)
        if tier is None:
            raise NotEnabled(Reason.TIER_NOT_ENABLED, f"The tier {tier_name!r} is not enabled on this server.")
        if not tier.models:  # declared, but its models list is empty: say so, not "no such tier"
            raise NotEnabled(
                Reason.TIER_NOT_ENABLED,
                f"The tier {tier_name!r} serves no models on this server (tiers.{tier_name}.models is empty).",
            )
        return tier

    def _asked_model(self, tier: TierConfig, requested_model: str | None) -> str:
        if requested_model is None or requested_model in MODEL_ALIASES:
            return tier.models[0]
        if requested_model not in self._models or requested_model not in tier.models:
            # the same answer for "unknown" and "not in your tier": no probing of other tiers
            raise NotFound(
                Reason.MODEL_NOT_FOUND,
                f"The model `{requested_model}` does not exist or you do not have access to it.",
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
