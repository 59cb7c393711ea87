"""Provider drivers: translate a chat request to one provider's API and classify failures.

A driver never decides a retry or a failover; the routing core does (contract §5).
"""

from router.drivers.anthropic import AnthropicDriver
from router.drivers.base import (
    ATTEMPT_ID_HEADER,
    AttemptBinding,
    AttemptTimeouts,
    ChatRequest,
    Driver,
    DriverResult,
    DriverStream,
    NativeBody,
    PreparedCall,
    UpstreamFailure,
)
from router.drivers.openai import OpenAIDriver

__all__ = [
    "ATTEMPT_ID_HEADER",
    "AnthropicDriver",
    "AttemptBinding",
    "AttemptTimeouts",
    "ChatRequest",
    "Driver",
    "DriverResult",
    "DriverStream",
    "NativeBody",
    "OpenAIDriver",
    "PreparedCall",
    "UpstreamFailure",
    "driver_for",
]


def driver_for(kind: str) -> Driver:
    """A new driver for an endpoint's ``driver`` setting (``openai`` or ``anthropic``)."""
    if kind == "anthropic":
        return AnthropicDriver()
    if kind == "openai":
        return OpenAIDriver()
    raise ValueError(f"unknown driver {kind!r}")
