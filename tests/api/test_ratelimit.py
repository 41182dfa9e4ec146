"""The rate-limit table stays bounded when a client rotates its identity (issue 10: it grew without bound)."""
from __future__ import annotations

from cosyedge.api.ratelimit import RateLimiter


def test_rotating_clients_never_grow_the_table_past_its_bound():
    limiter = RateLimiter(rate=0.001, burst=2, max_clients=100)
    for i in range(5000):  # every request from a "new" client, each leaving a partly drained bucket
        assert limiter.take(f"rotated-{i}") is None
    assert len(limiter) == 100


def test_a_steady_client_keeps_its_bucket_while_others_rotate():
    limiter = RateLimiter(rate=0.001, burst=2, max_clients=100)
    assert limiter.take("steady") is None and limiter.take("steady") is None
    for i in range(500):
        limiter.take(f"rotated-{i}")
        if i % 50 == 0:
            assert limiter.take("steady") is not None  # still limited: recently seen, so never evicted
    assert limiter.take("steady") is not None
