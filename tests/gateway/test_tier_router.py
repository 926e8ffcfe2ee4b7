"""The tier router: model choice per tier, visible fallback only under saturation, errors."""

from __future__ import annotations

import pytest

from gateway.errors import NotEnabled, NotFound, Overloaded, OverQuota, Reason
from gateway.queue import ModelQueue
from gateway.router import Route, TierRouter
from gateway.waiting_room import Offer
from settings import ConfigError, ModelConfig, QueueConfig, TierConfig
from testing.fake_backend import FakeBackend
from tests.gateway.fakes import FakeClock

MODELS = {
    "flagship": ModelConfig(fallback="mini"),
    "mini": ModelConfig(),
    "legacy": ModelConfig(),
}
TIERS = {
    "free": TierConfig(priority=0, models=["mini"], wait_target_s=30.0, budget_fallback=False),
    "plus": TierConfig(priority=1, models=["flagship", "mini"], wait_target_s=10.0, budget_fallback=True),
    "enterprise": TierConfig(priority=2, models=["flagship"], wait_target_s=5.0),
}


class Fixture:
    def __init__(self, **queue_config) -> None:
        self.clock = FakeClock()
        self.backends = {name: FakeBackend(words=()) for name in MODELS}
        config = QueueConfig(**{"max_waiting_requests": 100, "max_wait_s": 120.0, **queue_config})
        self.queues = {name: ModelQueue(name, config, b.has_room, self.clock) for name, b in self.backends.items()}
        self.router = TierRouter(MODELS, TIERS, self.queues)

    def saturate(self, model: str, num_waiting: int, stalled_s: float) -> None:
        """No room, `num_waiting` requests queued, nothing admitted for `stalled_s`."""
        self.backends[model].room = False
        for i in range(num_waiting):
            self.queues[model].enqueue(Offer(f"{model}-{i}", 2, 10))
        self.clock.advance(stalled_s)

    async def stop(self) -> None:
        for queue in self.queues.values():
            await queue.stop()


async def test_free_requests_land_on_mini_and_paid_tiers_on_the_flagship():
    fx = Fixture()
    for _ in range(20):
        assert fx.router.route("free", None) == Route("mini")
        assert fx.router.route("plus", None) == Route("flagship")
        assert fx.router.route("enterprise", "flagship") == Route("flagship")
        assert fx.router.route("plus", "mini") == Route("mini")


async def test_a_busy_flagship_within_the_wait_target_does_not_fall_back():
    fx = Fixture()
    fx.saturate("flagship", num_waiting=2, stalled_s=2.0)  # about 2 s per admission
    assert fx.router.route("plus", "flagship") == Route("flagship")
    await fx.stop()


async def test_a_saturated_flagship_falls_back_to_mini_and_says_so():
    fx = Fixture()
    fx.saturate("flagship", num_waiting=3, stalled_s=4.0)  # plus would wait about 16 s > 10 s
    assert fx.router.route("plus", "flagship") == Route("mini", "flagship", "busy")
    assert fx.router.route("plus", None) == Route("mini", "flagship", "busy")
    await fx.stop()


async def test_a_full_flagship_queue_counts_as_saturated():
    fx = Fixture(max_waiting_requests=2)
    fx.saturate("flagship", num_waiting=2, stalled_s=0.0)
    assert fx.router.route("plus", "flagship") == Route("mini", "flagship", "busy")
    await fx.stop()


async def test_the_models_configured_fallback_is_tried_after_the_tiers_own_models():
    fx = Fixture()
    fx.saturate("flagship", num_waiting=3, stalled_s=4.0)
    # enterprise lists only the flagship; its ModelConfig.fallback names mini
    assert fx.router.route("enterprise", "flagship") == Route("mini", "flagship", "busy")
    await fx.stop()


async def test_every_candidate_saturated_sheds_a_lower_tier_with_retry_after():
    fx = Fixture()
    fx.saturate("flagship", num_waiting=3, stalled_s=0.0)
    fx.saturate("mini", num_waiting=3, stalled_s=20.0)
    with pytest.raises(Overloaded) as info:
        fx.router.route("plus", "flagship")
    assert info.value.reason is Reason.WAIT_TOO_LONG
    assert info.value.retry_after_s >= 20
    await fx.stop()


async def test_the_top_tier_is_never_refused_for_its_wait_target():
    fx = Fixture()
    fx.saturate("flagship", num_waiting=3, stalled_s=0.0)
    fx.saturate("mini", num_waiting=3, stalled_s=20.0)  # 80 s estimated on both: far past 5 s
    assert fx.router.route("enterprise", "flagship") == Route("flagship")
    assert fx.router.wait_limit_s("enterprise", "flagship") == 120.0  # only the queue's max_wait_s
    assert fx.router.wait_limit_s("plus", "flagship") == 10.0
    assert fx.router.wait_limit_s("free", "mini") == 10.0  # never above a higher tier's: shed first
    await fx.stop()


async def test_a_top_tier_refusal_names_the_full_queue_not_its_wait_target():
    fx = Fixture(max_waiting_requests=3)
    fx.saturate("flagship", num_waiting=3, stalled_s=20.0)
    fx.saturate("mini", num_waiting=3, stalled_s=0.0)
    with pytest.raises(Overloaded) as info:
        fx.router.route("enterprise", "flagship")
    assert info.value.reason is Reason.QUEUE_FULL
    await fx.stop()


async def test_a_model_outside_the_tier_is_404_naming_the_model():
    fx = Fixture()
    with pytest.raises(NotFound) as info:
        fx.router.route("free", "flagship")
    assert (info.value.reason, info.value.param) == (Reason.MODEL_NOT_FOUND, "model")
    assert "`flagship`" in info.value.message


async def test_an_unknown_model_is_404():
    fx = Fixture()
    with pytest.raises(NotFound):
        fx.router.route("enterprise", "gpt-9")


async def test_auto_means_the_tiers_first_model():
    fx = Fixture()
    assert fx.router.route("plus", "auto") == Route("flagship")
    assert fx.router.route("free", "auto") == Route("mini")


async def test_over_budget_serves_the_tiers_cheapest_model_when_allowed():
    fx = Fixture()
    assert fx.router.route("plus", "flagship", over_budget=True) == Route("mini", "flagship", "over_budget")


async def test_over_budget_without_budget_fallback_is_a_quota_error_that_says_do_not_retry():
    fx = Fixture()
    with pytest.raises(OverQuota) as info:
        fx.router.route("free", None, over_budget=True)
    assert info.value.reason is Reason.OVER_QUOTA and not info.value.should_retry


async def test_a_request_too_big_for_every_queue_is_503():
    fx = Fixture(max_waiting_tokens=100)
    for backend in fx.backends.values():
        backend.room = False
    with pytest.raises(Overloaded) as info:
        fx.router.route("plus", None, num_tokens=101)
    assert info.value.reason is Reason.QUEUE_FULL


async def test_models_for_tier_lists_the_tiers_models_in_order_and_unknown_tiers_are_403():
    fx = Fixture()
    assert fx.router.models_for_tier("plus") == ["flagship", "mini"]
    with pytest.raises(NotEnabled, match="not enabled"):
        fx.router.route("platinum", None)
    router = TierRouter(MODELS, {**TIERS, "free": TierConfig(models=[])}, fx.queues)
    with pytest.raises(NotEnabled, match=r"serves no models .*tiers\.free\.models is empty"):
        router.route("free", None)


async def test_a_model_without_a_queue_is_skipped():
    fx = Fixture()
    queues = {"mini": fx.queues["mini"]}
    router = TierRouter(MODELS, TIERS, queues)
    assert router.route("plus", "flagship") == Route("mini", "flagship", "unavailable")


def test_a_tier_naming_an_undeclared_model_is_a_config_error():
    with pytest.raises(ConfigError, match=r"tiers\.free\.models"):
        TierRouter(MODELS, {"free": TierConfig(models=["nope"])}, {})
    with pytest.raises(ConfigError, match=r"models\.a\.fallback"):
        TierRouter({"a": ModelConfig(fallback="zz")}, {}, {})


async def test_retry_after_stays_finite_when_every_wait_estimate_is_unbounded():
    fx = Fixture(aging_s=0.0, max_wait_s=10**9)
    fx.saturate("mini", num_waiting=30, stalled_s=1.0)  # enterprise floods faster than it is served
    with pytest.raises(Overloaded) as info:
        fx.router.route("free", None)
    assert info.value.retry_after_s == 60.0
    await fx.stop()


async def test_precheck_refuses_only_when_no_model_the_tier_may_ask_for_takes_a_request():
    fx = Fixture()
    fx.saturate("flagship", num_waiting=3, stalled_s=4.0)  # plus would wait about 16 s > 10 s
    fx.router.precheck("plus")  # mini still takes plus requests, whatever the body asks for
    fx.saturate("mini", num_waiting=3, stalled_s=20.0)
    with pytest.raises(Overloaded) as info:
        fx.router.precheck("plus")
    assert info.value.reason is Reason.WAIT_TOO_LONG
    fx.router.precheck("enterprise")  # the top tier still has a place
    fx.router.precheck("nobody")  # not a load refusal: route reports it with the model asked
    await fx.stop()
