"""The read-model follower's supervision (ledger.views.follow): what the gateway does when its
child cannot be started. Starting, restarting and stopping a real child are covered through
`waybill serve` in tests/gateway/test_serve_cli.py."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from ledger.views.follow import follow_in_child


async def test_a_follower_that_cannot_be_started_is_retried_not_fatal(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stop = asyncio.Event()
    attempts = 0

    async def no_processes_left(*args: Any, **kwargs: Any) -> Any:
        nonlocal attempts
        attempts += 1
        if attempts == 2:
            stop.set()
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(asyncio, "create_subprocess_exec", no_processes_left)
    with caplog.at_level(logging.ERROR, logger="ledger.views.follow"):
        await asyncio.wait_for(
            follow_in_child("sqlite:///unused.db", stop, restart_after_s=0.01), 10
        )
    assert attempts == 2
    assert "could not start the read-model follower" in caplog.text
