"""The gateway of one config generation (moving: the request's walk is in
:mod:`router.request.executor`)."""

from router.request.executor import (
    Caller,
    Completion,
    Gateway,
    KeyMoved,
    StreamingCompletion,
)

__all__ = ["Caller", "Completion", "Gateway", "KeyMoved", "StreamingCompletion"]
