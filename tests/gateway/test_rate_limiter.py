"""Token buckets and the per-key / per-tier rate limiter, on a fake clock."""

from __future__ import annotations

import math

import pytest

from api.errors import from_gateway, ratelimit_headers
from gateway.ratelimit import RateLimited, RateLimiter, RateLimitReason, TokenBucket, format_reset
from settings import TierConfig
from tests.gateway.fakes import FakeClock


def headers_of(limiter: RateLimiter, *args) -> dict[str, str]:
    """The x-ratelimit-* headers the API renders from the limiter's bucket views."""
    return ratelimit_headers(limiter.buckets(*args))


def tier(**kwargs) -> TierConfig:
    return TierConfig(**{"requests_per_minute": 5, "tokens_per_minute": 1000, **kwargs})


def test_burst_of_n_plus_one_admits_n_and_refuses_one_with_retry_after():
    clock = FakeClock()
    limiter = RateLimiter(clock)
    for _ in range(5):
        limiter.acquire("k1", "free", tier(), 10)
    with pytest.raises(RateLimited) as info:
        limiter.acquire("k1", "free", tier(), 10)
    assert info.value.reason is RateLimitReason.KEY_REQUESTS
    assert info.value.retry_after_s == pytest.approx(12.0)  # one request refills in 60/5 s
    error = from_gateway(info.value)
    assert error.status == 429
    assert error.code == "rate_limit_exceeded"
    assert error.headers["Retry-After"] == "12"
    assert error.headers["retry-after-ms"] == "12000"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-should-retry" not in error.headers


def test_remaining_requests_and_tokens_fall_monotonically_during_a_burst():
    limiter = RateLimiter(FakeClock())
    seen = []
    for _ in range(5):
        limiter.acquire("k1", "free", tier(), 100)
        headers = headers_of(limiter, "k1", "free", tier())
        seen.append((int(headers["x-ratelimit-remaining-requests"]), int(headers["x-ratelimit-remaining-tokens"])))
    assert seen == [(4, 900), (3, 800), (2, 700), (1, 600), (0, 500)]


def test_capacity_refills_after_the_period():
    clock = FakeClock()
    limiter = RateLimiter(clock)
    for _ in range(5):
        limiter.acquire("k1", "free", tier(), 10)
    clock.advance(12.0)
    limiter.acquire("k1", "free", tier(), 10)  # exactly one request has refilled
    with pytest.raises(RateLimited):
        limiter.acquire("k1", "free", tier(), 10)
    clock.advance(60.0)
    headers = headers_of(limiter, "k1", "free", tier())
    assert headers["x-ratelimit-remaining-requests"] == "5"
    assert headers["x-ratelimit-reset-requests"] == "0s"


def test_settle_refunds_unused_tokens_exactly_once():
    limiter = RateLimiter(FakeClock())
    reservation = limiter.acquire("k1", "free", tier(), 600)
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-tokens"] == "400"
    limiter.settle(reservation, 100)
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-tokens"] == "900"
    limiter.settle(reservation, 100)
    limiter.cancel(reservation)
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-tokens"] == "900"
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-requests"] == "4"


def test_settle_charges_an_overrun_and_only_settle_goes_below_zero():
    clock = FakeClock()
    limiter = RateLimiter(clock)
    reservation = limiter.acquire("k1", "free", tier(), 900)
    limiter.settle(reservation, 1300)  # the real prompt was longer than estimated
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimited) as info:
        limiter.acquire("k1", "free", tier(), 100)
    # level is -300; 400 tokens refill at 1000/60 per second
    assert info.value.retry_after_s == pytest.approx(400 / (1000 / 60))


def test_cancel_refunds_the_request_and_every_token():
    limiter = RateLimiter(FakeClock())
    reservation = limiter.acquire("k1", "free", tier(tier_tokens_per_minute=5000), 600)
    limiter.cancel(reservation)
    headers = headers_of(limiter, "k1", "free", tier(tier_tokens_per_minute=5000))
    assert headers["x-ratelimit-remaining-requests"] == "5"
    assert headers["x-ratelimit-remaining-tokens"] == "1000"
    assert reservation.is_settled


def test_a_refusal_debits_no_bucket():
    limiter = RateLimiter(FakeClock())
    shared = tier(tier_tokens_per_minute=1500)
    limiter.acquire("k1", "free", shared, 1000)
    with pytest.raises(RateLimited) as info:
        limiter.acquire("k2", "free", shared, 900)  # k2's own bucket is fine, the tier's is not
    assert info.value.reason is RateLimitReason.TIER_TOKENS
    headers = headers_of(limiter, "k2", "free", tier())  # k2 alone, without the tier limit
    assert headers["x-ratelimit-remaining-requests"] == "5"
    assert headers["x-ratelimit-remaining-tokens"] == "1000"


def test_tier_bucket_is_shared_by_every_key_of_the_tier():
    limiter = RateLimiter(FakeClock())
    shared = tier(tier_requests_per_minute=3)
    for key in ("k1", "k2", "k3"):
        limiter.acquire(key, "plus", shared, 1)
    with pytest.raises(RateLimited) as info:
        limiter.acquire("k4", "plus", shared, 1)
    assert info.value.reason is RateLimitReason.TIER_REQUESTS
    limiter.acquire("k4", "free", shared, 1)  # another tier has its own bucket
    assert headers_of(limiter, "k1", "plus", shared)["x-ratelimit-limit-requests"] == "3"


def test_org_overrides_replace_the_per_key_limits():
    limiter = RateLimiter(FakeClock())
    overrides = {"requests_per_minute": 2}
    limiter.acquire("k1", "free", tier(), 1, overrides)
    limiter.acquire("k1", "free", tier(), 1, overrides)
    with pytest.raises(RateLimited):
        limiter.acquire("k1", "free", tier(), 1, overrides)
    assert headers_of(limiter, "k1", "free", tier(), overrides)["x-ratelimit-limit-requests"] == "2"
    # other tier settings in an org's overrides are not the limiter's business
    limiter.acquire("k2", "free", tier(), 1, {"max_tokens": 5, "requests_per_minute": 1.0})
    assert headers_of(limiter, "k2", "free", tier(), {"requests_per_minute": 1.0})["x-ratelimit-limit-requests"] == "1"


def test_raising_a_limit_keeps_what_was_already_used():
    limiter = RateLimiter(FakeClock())
    limiter.acquire("k1", "free", tier(), 400)
    headers = headers_of(limiter, "k1", "free", tier(), {"tokens_per_minute": 2000})
    assert headers["x-ratelimit-remaining-tokens"] == "1600"
    limiter.acquire("k1", "free", tier(), 1500, {"tokens_per_minute": 2000})
    assert (
        headers_of(limiter, "k1", "free", tier(), {"tokens_per_minute": 2000})["x-ratelimit-remaining-tokens"] == "100"
    )


def test_a_request_larger_than_the_token_capacity_is_refused_without_retry():
    limiter = RateLimiter(FakeClock())
    with pytest.raises(RateLimited) as info:
        limiter.acquire("k1", "free", tier(), 1001)
    assert info.value.reason is RateLimitReason.REQUEST_TOO_LARGE
    assert not info.value.should_retry
    assert from_gateway(info.value).headers["x-should-retry"] == "false"
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-requests"] == "5"


def test_zero_limits_mean_unlimited_and_send_no_headers():
    limiter = RateLimiter(FakeClock())
    unlimited = tier(requests_per_minute=0, tokens_per_minute=0)
    for _ in range(100):
        limiter.acquire("k1", "local", unlimited, 10**6)
    assert headers_of(limiter, "k1", "local", unlimited) == {}


def test_reset_header_counts_down_to_a_full_bucket():
    clock = FakeClock()
    limiter = RateLimiter(clock)
    limiter.acquire("k1", "free", tier(), 100)
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-reset-tokens"] == "6s"
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-reset-requests"] == "12s"
    clock.advance(11.5)
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-reset-requests"] == "500ms"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (0.012, "12ms"),
        (0.0001, "1ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (360.0, "6m0s"),
        (90.25, "1m30.25s"),
        (3600.0, "1h0m0s"),
        (-2.0, "0s"),
    ],
)
def test_reset_durations_are_written_the_way_openai_writes_them(seconds, text):
    assert format_reset(seconds) == text


def test_stream_tickets_cap_concurrency_and_release_exactly_once():
    limiter = RateLimiter(FakeClock())
    first = limiter.open_stream("k1", 2)
    with limiter.open_stream("k1", 2):
        assert limiter.num_streams("k1") == 2
        with pytest.raises(RateLimited) as info:
            limiter.open_stream("k1", 2)
        assert info.value.reason is RateLimitReason.CONCURRENT_STREAMS
        assert limiter.open_stream("k2", 2).key == "k2"  # other keys are unaffected
    assert limiter.num_streams("k1") == 1
    first.release()
    first.release()
    assert limiter.num_streams("k1") == 0
    for _ in range(50):
        limiter.open_stream("k3", 0)  # 0: unlimited


def test_prune_forgets_only_full_buckets():
    clock = FakeClock()
    limiter = RateLimiter(clock)
    limiter.acquire("old", "free", tier(), 10)
    clock.advance(61.0)
    limiter.acquire("new", "free", tier(), 10)
    limiter.prune()
    assert limiter.num_buckets == 2  # "new" requests + tokens; "old" had refilled
    assert headers_of(limiter, "old", "free", tier())["x-ratelimit-remaining-requests"] == "5"
    assert headers_of(limiter, "new", "free", tier())["x-ratelimit-remaining-requests"] == "4"


def test_settle_after_prune_never_grants_more_than_capacity():
    clock = FakeClock()
    limiter = RateLimiter(clock)
    reservation = limiter.acquire("k1", "free", tier(), 900)
    clock.advance(120.0)
    limiter.prune()
    limiter.settle(reservation, 0)
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-tokens"] == "1000"


def test_token_bucket_alone_reports_retry_after_for_a_given_need():
    clock = FakeClock()
    bucket = TokenBucket(capacity=10, refill_per_s=2, clock=clock)
    bucket.take(10)
    assert bucket.retry_after_s(4) == pytest.approx(2.0)
    assert math.isinf(bucket.retry_after_s(11))
    with pytest.raises(ValueError):
        bucket.take(1)
    clock.advance(1.0)
    assert bucket.level == pytest.approx(2.0)
    assert bucket.reset_s() == pytest.approx(4.0)


def test_top_up_moves_the_debit_from_the_byte_estimate_to_the_real_size():
    limiter = RateLimiter(FakeClock())
    reservation = limiter.acquire("k1", "free", tier(), 100)  # estimated from the body's bytes
    limiter.top_up(reservation, 300)  # prompt + max_tokens once tokenized
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-tokens"] == "700"
    limiter.top_up(reservation, 250)  # a smaller real size gives the difference back
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-tokens"] == "750"
    with pytest.raises(RateLimited) as info:
        limiter.top_up(reservation, 1001)
    assert info.value.reason is RateLimitReason.REQUEST_TOO_LARGE
    other = limiter.acquire("k1", "free", tier(), 700)
    with pytest.raises(RateLimited) as info:
        limiter.top_up(other, 800)  # 50 tokens left: the extra 100 is not there
    assert info.value.reason is RateLimitReason.KEY_TOKENS
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-tokens"] == "50"
    limiter.cancel(other)  # a refusal refunds what was taken, the top-up included
    limiter.settle(reservation, 40)
    assert headers_of(limiter, "k1", "free", tier())["x-ratelimit-remaining-tokens"] == "960"
