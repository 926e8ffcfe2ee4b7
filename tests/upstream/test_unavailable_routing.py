"""A model whose upstream replicas are all down: the router falls back visibly, else a 503
`model_unavailable` with Retry-After; its queue takes no new requests until it is back."""

from __future__ import annotations

import pytest

from api.errors import from_gateway
from gateway.errors import Overloaded, Reason
from gateway.queue import ModelQueue
from gateway.router import TierRouter
from gateway.waiting_room import Offer
from settings import ModelConfig, QueueConfig, TierConfig

MODELS = {"big": ModelConfig(fallback="small"), "small": ModelConfig(), "alone": ModelConfig()}
TIERS = {"plus": TierConfig(models=["big", "alone"])}


@pytest.fixture
async def setup():
    up = {"big": False, "small": True, "alone": False}
    queues = {
        name: ModelQueue(name, QueueConfig(), lambda: True, capacity=2, is_available=lambda n=name: up[n])
        for name in MODELS
    }
    yield TierRouter(MODELS, TIERS, queues), queues, up
    for queue in queues.values():
        await queue.stop()


async def test_an_unreachable_model_falls_back_to_its_configured_fallback_and_says_so(setup):
    router, _, _ = setup
    route = router.route("plus", "big")
    assert route.model == "small" and route.fallback_from == "big"


async def test_an_unreachable_model_without_fallback_is_503_model_unavailable(setup):
    router, _, _ = setup
    with pytest.raises(Overloaded) as info:
        router.route("plus", "alone")
    assert info.value.reason is Reason.MODEL_UNAVAILABLE
    error = from_gateway(info.value)
    assert error.status == 503 and error.code == "model_unavailable" and int(error.headers["Retry-After"]) >= 1


async def test_the_queue_of_an_unreachable_model_refuses_and_takes_again_when_it_is_back(setup):
    _, queues, up = setup
    with pytest.raises(Overloaded):
        queues["alone"].enqueue(Offer("r1", 0, 10))
    up["alone"] = True
    assert await queues["alone"].enqueue(Offer("r2", 0, 10)).wait(1.0)
