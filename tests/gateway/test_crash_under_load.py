"""kill -9 under load, restart, and audit the ledger: every answered request is complete,
every started attempt is finished or an unknown-usage settlement, no hold is lost, and the
hash chain verifies.

The holds are held to contract §6 and §7 "Crash recovery": each is resolved exactly once, none
stays ``held``, and the ones held as unknown usage are exactly those the ledger's attempts call
for: every hold a crash left open (read from the ledger right after each kill), and every
hold whose attempt its own gateway finished with its usage unknown."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from ledger.store import RecordedEvent
from router.fake_provider import Behavior, FakeUpstream
from tests.gateway.harness import Route, closed_port, config_text
from tests.gateway.processes import new_key, serve_process
from tests.helpers import ledger_events
from tests.ledger.test_cli import waybill

BODY: dict[str, Any] = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}

# How a hold is resolved (contract §6): each of these names the reservation it resolves.
RESOLUTIONS = ("BudgetSettled", "BudgetReleased", "UnknownUsageOpened")
CRASH_RECOVERY = "crash_recovery"  # UnknownUsageOpened.cause of a hold recovery took


def _ledger(database_url: str) -> list[RecordedEvent]:
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            return ledger_events(conn)
    finally:
        engine.dispose()


def _left_open(events: list[RecordedEvent]) -> set[str]:
    """The reservations no event resolves: right after a kill, the holds it left open."""
    reserved = {e.data["reservation_id"] for e in events if e.type == "BudgetReserved"}
    return reserved - {e.data["reservation_id"] for e in events if e.type in RESOLUTIONS}


def _how_resolved(
    reserved: dict[str, str], events: list[RecordedEvent], left_open: set[str]
) -> dict[str, str]:
    """What each reservation's one resolution must be, by what the ledger says of its attempt
    (contract §6): a hold a crash left open becomes unknown usage by crash recovery; else the
    attempt's own end decides: nothing started, released; usage reported, settled; else held
    as unknown usage."""
    finished = {e.data["attempt_id"]: e.data for e in events if e.type == "AttemptFinished"}
    due: dict[str, str] = {}
    for reservation, attempt in reserved.items():
        end = finished.get(attempt)
        if reservation in left_open:
            due[reservation] = CRASH_RECOVERY
        elif end is None:
            due[reservation] = "AttemptFinished missing"
        elif end["evidence"] == "not_started":
            due[reservation] = "BudgetReleased"
        elif end.get("usage") is not None:
            due[reservation] = "BudgetSettled"
        else:
            due[reservation] = "UnknownUsageOpened"
    return due


def _assert_holds_as_the_attempts_call_for(
    events: list[RecordedEvent], books: dict[str, str], left_open: set[str]
) -> None:
    """Every hold is resolved exactly once, as its attempt calls for; in the books nothing
    stays ``held``, and exactly the holds due to be unknown usage are held unknown."""
    reserved = {
        e.data["reservation_id"]: e.data["attempt_id"] for e in events if e.type == "BudgetReserved"
    }
    resolved: dict[str, list[str]] = {}
    for e in events:
        if e.type in RESOLUTIONS:
            how = CRASH_RECOVERY if e.data.get("cause") == CRASH_RECOVERY else e.type
            resolved.setdefault(e.data["reservation_id"], []).append(how)
    assert not [e for e in events if e.type == "UnknownUsageSettled"]  # nobody settled by hand
    assert resolved.keys() == reserved.keys(), "a hold unresolved, or resolved without its hold"
    twice = {r: how for r, how in resolved.items() if len(how) != 1}
    assert not twice, f"holds resolved more than once: {twice}"
    due = _how_resolved(reserved, events, left_open)
    wrong = sorted((r, how[0], due[r]) for r, how in resolved.items() if how[0] != due[r])
    assert not wrong, f"{len(wrong)} holds resolved otherwise than due, e.g. {wrong[:5]}"
    lost = {
        e.data["attempt_id"]
        for e in events
        if e.type == "AttemptFinished" and e.data.get("error_code") == "gateway_lost"
    }
    assert lost == {reserved[r] for r in left_open}, "an open attempt not ended as gateway_lost"
    assert books.keys() == reserved.keys()
    assert [r for r, state in books.items() if state == "held"] == []
    unknown = {r for r, state in books.items() if state == "unknown"}
    unknown_due = {r for r, how in due.items() if how in (CRASH_RECOVERY, "UnknownUsageOpened")}
    assert unknown == unknown_due, (
        f"{len(unknown)} holds held unknown; the ledger's attempts call for {len(unknown_due)}: "
        f"{len(left_open)} left open by the crashes, the rest ended with their usage unknown"
    )


async def _load(
    port: int,
    secret: str,
    seconds: float,
    answered: list[str],
    stop: asyncio.Event,
    first: asyncio.Event,
) -> None:
    async def worker() -> None:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {secret}"},
            timeout=5,
        ) as http:
            until = time.monotonic() + seconds
            while time.monotonic() < until and not stop.is_set():
                try:
                    stream = random.random() < 0.3
                    response = await http.post(
                        "/v1/chat/completions", json={**BODY, "stream": stream}
                    )
                    await response.aread()
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)  # the gateway is down: try again
                    continue
                if response.status_code == 200 and (not stream or b"[DONE]" in response.content):
                    answered.append(response.headers["x-request-id"])
                    first.set()

    await asyncio.gather(*(worker() for _ in range(8)))


@pytest.mark.slow
def test_kill_9_under_load_loses_nothing(database_url: str, tmp_path: Path) -> None:
    # On both backends: on SQLite every commit is a whole batch in one transaction on the
    # writer thread (ledger.store.sqlite), in WAL mode with synchronous=FULL; a kill between
    # (or inside) its commits must leave a ledger that verifies, books included, with every
    # answered request complete.
    rng = random.Random(7)
    with FakeUpstream("east", default=Behavior.ok(latency_ms=30, chunk_delay_ms=10)) as east:
        config = tmp_path / "waybill.yaml"
        config.write_text(
            config_text(
                {"east": east},
                [Route("east")],
                workspace_extra="    budget: {limit_usd: 1000, window: month}",
            )
        )
        secret = new_key(database_url)
        port = closed_port()
        answered: list[str] = []
        left_open: set[str] = set()
        for _ in range(3):
            process = serve_process(config, database_url, port, env={"WAYBILL_HEARTBEAT_S": "0.2"})
            killer_delay = rng.uniform(0.5, 1.5)

            async def run(
                process: subprocess.Popen[bytes] = process, delay: float = killer_delay
            ) -> None:
                stop = asyncio.Event()
                first = asyncio.Event()
                load = asyncio.create_task(_load(port, secret, 30, answered, stop, first))
                # The kill comes mid-load: after the first answer of this round (on a busy
                # machine the first requests may take a while), then a random delay.
                async with asyncio.timeout(20):
                    await first.wait()
                await asyncio.sleep(delay)
                process.send_signal(signal.SIGKILL)
                await asyncio.sleep(0.5)
                stop.set()
                await load

            asyncio.run(run())
            process.wait(timeout=10)
            # Before the next gateway starts (and recovers them): the holds this crash left.
            # The kill came at least half a second ago, so no commit of it is still on its way.
            left_open |= _left_open(_ledger(database_url))
        # A survivor recovers the dead gateways' holds.
        survivor = serve_process(config, database_url, port, env={"WAYBILL_HEARTBEAT_S": "0.2"})
        try:
            engine = sa.create_engine(database_url)
            deadline = time.monotonic() + 30
            while True:
                with engine.connect() as conn:
                    held = conn.execute(
                        sa.text("SELECT count(*) FROM budget_open_holds WHERE state = 'held'")
                    ).scalar_one()
                if held == 0:
                    break
                assert time.monotonic() < deadline, f"{held} holds never recovered"
                time.sleep(0.2)
            with engine.connect() as conn:
                rows = ledger_events(conn)
                books: dict[str, str] = {
                    str(reservation): str(state)
                    for reservation, state in conn.execute(
                        sa.text(
                            "SELECT h.reservation_id, coalesce(o.state, 'resolved') "
                            "FROM budget_holds h LEFT JOIN budget_open_holds o USING "
                            "(reservation_id)"
                        )
                    )
                }
            engine.dispose()
        finally:
            survivor.terminate()
            survivor.wait(timeout=20)
    assert answered, "the load never got an answer"
    by_request: dict[str, list[str]] = {}
    started: set[str] = set()
    ended: set[str] = set()
    for stream_id, event_type, data in ((e.stream_id, e.type, e.data) for e in rows):
        by_request.setdefault(stream_id, []).append(event_type)
        if event_type == "AttemptStarted":
            started.add(data["attempt_id"])
        if event_type in ("AttemptFinished", "UnknownUsageOpened"):
            ended.add(data["attempt_id"])
    for request_id in answered:
        assert "RequestCompleted" in by_request[f"request-{request_id}"], request_id
    assert started <= ended, f"{len(started - ended)} attempts neither finished nor held"
    _assert_holds_as_the_attempts_call_for(rows, books, left_open)
    verified = waybill("verify", database_url=database_url)
    assert verified.returncode == 0, verified.stdout
    books_verified = waybill("verify", "--books", database_url=database_url)
    assert books_verified.returncode == 0, books_verified.stdout
