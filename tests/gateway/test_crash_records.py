"""Crash records that say what the client saw: a stream is on the ledger as committed
before the client's first byte, or the client gets a 503 and nothing of it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from ledger import events as ev
from ledger.schema import budget_holds
from ledger.store import LedgerUnavailable, RecordedEvent
from router.fake_upstream import Behavior
from tests.gateway.harness import Route, running_gateway

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
STREAM_BODY: dict[str, Any] = {**BODY, "stream": True}


def _on_stream_commit(store: Any, commit: Callable[..., Any]) -> None:
    """Route the appends that carry ``StreamCommitted`` through ``commit`` (same arguments
    as ``store.submit``, returns the future); every other append goes as usual."""
    real_submit = store.submit

    def submit(stream_id: str, expected: int | None, events: Any, **kwargs: Any) -> Any:
        if any(isinstance(event, ev.StreamCommitted) for event in events):
            return commit(real_submit, stream_id, expected, events, **kwargs)
        return real_submit(stream_id, expected, events, **kwargs)

    store.submit = submit


async def test_a_stream_is_recorded_as_committed_before_the_client_gets_a_byte(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:
        gw.upstreams["east"].set_default(Behavior.ok(chunk_delay_ms=200))

        def slow_commit(real_submit: Any, *args: Any, **kwargs: Any) -> Any:
            async def later() -> list[RecordedEvent]:
                await asyncio.sleep(0.3)  # a slow commit: the client must wait for it
                recorded: list[RecordedEvent] = await real_submit(*args, **kwargs)
                return recorded

            return asyncio.ensure_future(later())

        _on_stream_commit(gw.served_store, slow_commit)
        async with (
            gw.http() as http,
            http.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as streamed,
        ):
            assert streamed.status_code == 200  # the headers are here: the commit is too
            on_ledger = await gw.types(streamed.headers["x-request-id"])
            await streamed.aread()
        # Recorded before the headers went out, and the stream was still going.
        assert on_ledger[3:] == ["AttemptStarted", "StreamCommitted"], on_ledger


async def test_a_stream_whose_commit_cannot_be_recorded_is_a_503_before_any_byte(database_url):
    async with running_gateway(database_url, ["east"], [Route("east")]) as gw:

        def unavailable(real_submit: Any, *args: Any, **kwargs: Any) -> Any:
            async def refused() -> list[RecordedEvent]:
                raise LedgerUnavailable("the database went away")

            return asyncio.ensure_future(refused())

        _on_stream_commit(gw.served_store, unavailable)
        async with gw.http() as http:
            response = await http.post("/v1/chat/completions", json=STREAM_BODY)
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "ledger_unavailable"
        assert b"data:" not in response.content
        assert gw.upstreams["east"].hits == 1
        request_id = response.headers["x-request-id"]
        types = await gw.wait_for_types(request_id, "RequestFailed")
        assert types[3:] == [
            "AttemptStarted",
            "AttemptFinished",
            "UnknownUsageOpened",  # the upstream did start: its usage is unknown, not free
            "RequestFailed",
        ]
        events = await gw.events(request_id)
        finished, opened, failed = (e.data for e in events[4:])
        assert (finished["evidence"], finished["error_code"], finished["stream_committed"]) == (
            "started",
            "ledger_unavailable",
            False,
        )
        assert opened["cause"] == "ledger_unavailable"
        assert (failed["http_status"], failed["stream_started"]) == (503, False)
        async with gw.store.engine.connect() as conn:
            states = (await conn.execute(sa.select(budget_holds.c.state))).scalars().all()
        assert states == ["unknown"]
