"""What a request counts against at admission: its key's own limits over its workspace's
``key_limits``, and its workspace's ``limits`` whatever the key."""

from __future__ import annotations

from router.adapters.rate_limits import RateLimit
from router.config import RateLimits, Workspace
from router.request.admission import limits_of
from router.request.call import Caller


def _workspace(**limits: RateLimits) -> Workspace:
    return Workspace(
        id="acme", models=("chat",), regions=frozenset({"eu"}), data_class="internal", **limits
    )


def test_a_keys_own_limits_replace_key_limits_and_the_workspace_total_still_counts() -> None:
    workspace = _workspace(
        key_limits=RateLimits(requests_per_minute=1),
        limits=RateLimits(tokens_per_minute=1000),
    )
    own = RateLimits(requests_per_minute=10, tokens_per_minute=500)
    assert limits_of(Caller("k1", workspace, "client", key_limits=own)) == (
        RateLimit("key:k1", 10, 500),
        RateLimit("workspace:acme", None, 1000),
    )
    assert limits_of(Caller("k2", workspace, "client")) == (
        RateLimit("key:k2", 1, None),
        RateLimit("workspace:acme", None, 1000),
    )


def test_a_keys_own_limits_apply_where_the_workspace_sets_none() -> None:
    own = RateLimits(requests_per_minute=2)
    assert limits_of(Caller("k1", _workspace(), "client", key_limits=own)) == (
        RateLimit("key:k1", 2, None),
    )
    assert limits_of(Caller("k2", _workspace(), "client")) == ()
