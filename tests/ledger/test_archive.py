"""Retention: closed months leave the database as files that carry their chain segment, the
live ledger goes on from their end hash, and `waybill verify` checks both as one chain.

The ledger spans three months: the store's clock is set to each month in turn, so every
event's recorded time is in its bytes and the chain is the one the store wrote."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import select, text

from ledger import apikeys
from ledger import events as ev
from ledger.audit.archive import ArchiveRefused, archive_months
from ledger.audit.book_audit import check_books, rebuild_books
from ledger.audit.verify import verify_chain
from ledger.books.accounting import Effect, effect_of
from ledger.store import ANY_VERSION, NO_STREAM, EventStore, WrongExpectedVersion
from ledger.store.archived import (
    ArchiveError,
    HistoryArchived,
    archived_segments,
    check_segment,
    read_segment,
)
from ledger.store.db import create_engine
from ledger.store.partitions import month_of
from ledger.store.schema import budget_accounts, budget_holds, budget_open_holds, budget_resolutions
from ledger.views import all_projections
from ledger.views.explain import explain
from ledger.views.projection import ProjectionRunner
from ledger.views.queries import RequestArchived, request_trail
from ledger.views.spend_queries import spend_report
from tests.console.support import browser, sign_in
from tests.gateway.harness import Route, running_gateway
from tests.ledger.factories import succeeded_trail

_NOW = datetime.now(UTC)


def _months_ago(count: int, day: int) -> datetime:
    months = _NOW.year * 12 + _NOW.month - 1 - count
    return datetime(months // 12, months % 12 + 1, day, tzinfo=UTC)


# Two closed months with a month between them (its table empty), and this one.
_MONTHS = [_months_ago(4, 15), _months_ago(3, 10), _NOW]
BOOK_TABLES = (budget_accounts, budget_holds, budget_open_holds, budget_resolutions)
_FIRST, _SECOND = (month_of(m) for m in _MONTHS[:2])


class _Clock:
    def __init__(self) -> None:
        self.moment = _MONTHS[0]

    def __call__(self) -> datetime:
        return self.moment


async def _three_months(
    database_url: str,
    *,
    requests: int = 3,
    adjusted: bool = False,
    folded: bool = True,
    books: bool = False,
) -> tuple[EventStore, _Clock]:
    """``requests`` requests a month; ``adjusted``: the first month's ``m0r1`` moved by a
    period adjustment recorded in the second; ``folded``: the read models caught up;
    ``books``: the budget events change the books (each request reserves, then settles,
    as the gateway appends them), and the first month's last request stays held."""
    clock = _Clock()
    store = EventStore(create_engine(database_url), clock=clock)
    for month, moment in enumerate(_MONTHS):
        clock.moment = moment
        for n in range(requests):
            trail, stream = succeeded_trail(f"m{month}r{n}"), f"request-m{month}r{n}"
            if not books:
                await store.append(stream, NO_STREAM, trail)
                continue
            held = await store.append(stream, NO_STREAM, trail[:4], effects=_effects(trail[:4]))
            if (month, n) != (0, requests - 1):
                await store.append(stream, held[-1].version, trail[4:], effects=_effects(trail[4:]))
        if adjusted and month == 1:
            await store.append(f"period-{_SECOND}", ANY_VERSION, [_adjustment_of_m0r1()])
    if folded:
        await ProjectionRunner(store, all_projections()).catch_up()
    return store, clock


def _effects(events: list[ev.Event]) -> list[Effect]:
    return [effect for event in events if (effect := effect_of(event)) is not None]


def _adjustment_of_m0r1() -> ev.PeriodAdjusted:
    return ev.PeriodAdjusted(
        period=_FIRST,
        in_period=_SECOND,
        request_id="m0r1",
        attempt_id="m0r1-a1",
        reservation_id="m0r1-a1-r",
        workspace="acme",
        cause="operator_settlement",
        settled_usd=Decimal("0.0005"),
        held_unknown_usd=Decimal(0),
        overrun_usd=Decimal(0),
    )


@pytest.fixture
def archive_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "archive"


@pytest.mark.postgres
async def test_closed_months_become_files_and_verify_checks_them_with_the_live_ledger(
    postgres_url: str, archive_dir: Path
) -> None:
    store, _ = await _three_months(postgres_url)
    try:
        before = await spend_report(store.engine, group_by=["workspace", "day"])
        first_of_this_month = date(_NOW.year, _NOW.month, 1)
        segments = await archive_months(store, first_of_this_month, archive_dir)

        assert [s.month for s in segments] == [_FIRST, _SECOND]
        assert [(s.first_position, s.last_position) for s in segments] == [(1, 21), (22, 42)]
        assert segments[1].previous_hash == segments[0].end_hash
        assert await archived_segments(store.engine) == segments
        for segment in segments:
            assert check_segment(archive_dir / segment.file) == segment
        async with store.engine.connect() as conn:
            live = (await conn.execute(text("SELECT min(position) FROM appends"))).scalar()
            tables = (
                await conn.execute(
                    text("SELECT tablename FROM pg_tables WHERE tablename LIKE 'appends_%'")
                )
            ).scalars()
            assert live == 43
            assert f"appends_{_FIRST.replace('-', '_')}" not in set(tables)

        # The live ledger verifies from the archive's end; with the files, as one chain.
        alone = await verify_chain(store)
        assert alone.ok and alone.checked == 21 and alone.archived == 42
        assert not alone.archive_checked
        whole = await verify_chain(store, archive=archive_dir)
        assert whole.ok and whole.checked == 63 and whole.archive_checked
        # Reads of the live ledger chain from the archive's end hash.
        [first_live] = await store.read_all(after=42, limit=1)
        assert first_live.position == 43
        assert first_live.hash == (await store.read_stream("request-m2r0"))[0].hash
        # The spend read model is not recomputed from the events that left.
        assert await spend_report(store.engine, group_by=["workspace", "day"]) == before
        # Streams go on from the versions they reached in the archived months: a late
        # settlement on an archived request, a second start of it refused.
        late = await store.append(
            "request-m0r1",
            ANY_VERSION,
            [
                ev.RequestFailed(
                    request_id="m0r1",
                    http_status=500,
                    error_code="gateway_lost",
                    error_type="server_error",
                    message="late",
                    attempts=1,
                    duration_ms=0,
                )
            ],
        )
        assert late[0].version == 8
        with pytest.raises(WrongExpectedVersion):
            await store.append("request-m1r2", NO_STREAM, succeeded_trail("m1r2")[:1])
        assert (await verify_chain(store, archive=archive_dir)).ok
        # A replay reads the archived months from their files: refused without them, saying
        # why; with them, the read models come back as the follower had folded them.
        runner = ProjectionRunner(store, all_projections())
        await runner.catch_up()
        folded = await _read_models(store)
        with pytest.raises(HistoryArchived, match="positions 1-42 are archived: give their"):
            await runner.replay()
        seen: list[tuple[int, int]] = []
        assert await runner.replay(archive=archive_dir, progress=lambda *p: seen.append(p)) == 64
        assert await _read_models(store) == folded
        assert seen[-1] == (64, 64) and seen[0][0] < 64
        # Nothing is archived twice; the current month never.
        assert await archive_months(store, date(2099, 1, 1), archive_dir) == []
    finally:
        await store.close()
        await store.engine.dispose()


async def _read_models(store: EventStore) -> dict[str, list[tuple[object, ...]]]:
    """Every row of every read model, and the books, in key order."""
    tables = [t for p in all_projections() for t in p.tables] + [*BOOK_TABLES]
    async with store.engine.connect() as conn:
        return {
            t.name: [tuple(r) for r in await conn.execute(select(t).order_by(*t.primary_key))]
            for t in tables
        }


@pytest.mark.postgres
async def test_the_books_are_checked_and_rebuilt_through_the_archive(
    postgres_url: str, archive_dir: Path
) -> None:
    store, _ = await _three_months(postgres_url, books=True)
    try:
        kept = await _read_models(store)
        assert len(kept["budget_open_holds"]) == 1  # the first month's last request
        await archive_months(store, date(_NOW.year, _NOW.month, 1), archive_dir)
        with pytest.raises(HistoryArchived, match="give their directory"):
            await check_books(store)
        checked = await check_books(store, archive=archive_dir)
        assert checked.ok and checked.holds == 9 and checked.events == 17

        async with store.engine.begin() as conn:  # edits made around the ledger
            await conn.execute(text("UPDATE budget_accounts SET settled_usd = settled_usd + 5"))
            await conn.execute(text("DELETE FROM budget_open_holds"))
        found = await check_books(store, archive=archive_dir)
        assert {(d.kind, d.id) for d in found.discrepancies} == {
            ("account", "workspace:acme"),
            ("hold", "m0r2-a1-r"),
        }
        rebuilt = await rebuild_books(store, archive=archive_dir)
        assert rebuilt.discrepancies == found.discrepancies
        assert await _read_models(store) == kept
        assert (await check_books(store, archive=archive_dir)).ok
    finally:
        await store.close()
        await store.engine.dispose()


@pytest.mark.postgres
async def test_verify_names_a_changed_archive_file(postgres_url: str, archive_dir: Path) -> None:
    store, _ = await _three_months(postgres_url)
    try:
        [august, _] = await archive_months(store, date(_NOW.year, _NOW.month, 1), archive_dir)
        header, events = read_segment(archive_dir / august.file)
        lines = [json.dumps(header)] + [f"{p} {h} {b.decode()}" for p, h, b in events]
        lines[6] = lines[6].replace("0.0012", "0.0001")  # position 6, the settlement
        trailer = {"end_hash": august.end_hash, "events": august.events, "last_position": 21}
        with gzip.open(archive_dir / august.file, "wb") as out:
            out.write(("\n".join([*lines, json.dumps(trailer)]) + "\n").encode())
        with pytest.raises(ArchiveError, match="hash does not match"):
            check_segment(archive_dir / august.file)
        result = await verify_chain(store, archive=archive_dir)
        assert not result.ok and "hash does not match" in (result.problem or "")
    finally:
        await store.close()
        await store.engine.dispose()


async def test_sqlite_refuses_to_archive_saying_why(sqlite_url: str, archive_dir: Path) -> None:
    store = EventStore(create_engine(sqlite_url))
    try:
        with pytest.raises(ArchiveRefused, match="needs PostgreSQL"):
            await archive_months(store, date(2026, 10, 1), archive_dir)
        assert not archive_dir.exists()  # noqa: ASYNC240 - nothing was written
    finally:
        await store.close()
        await store.engine.dispose()


@pytest.mark.postgres
async def test_the_cli_archives_with_progress_and_verify_reads_the_archive(
    postgres_url: str, archive_dir: Path
) -> None:
    store, _ = await _three_months(postgres_url, books=True)
    await store.close()
    await store.engine.dispose()
    month = month_of(_NOW)

    def waybill(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", "from router.cli.main import main; main()", *args]
        return subprocess.run(
            [*command, "--database-url", postgres_url], capture_output=True, text=True
        )

    archived = waybill("archive", "--before", f"{month}-01", "--to", str(archive_dir))
    assert archived.returncode == 0, archived.stderr
    assert f"archived {_FIRST}: positions 1-18 (18 events)" in archived.stdout
    assert "archiving" in archived.stderr  # the progress bar
    plain = waybill("verify")
    assert plain.returncode == 0 and "positions 1-39 archived, not checked" in plain.stdout
    whole = waybill("verify", "--archive", str(archive_dir))
    assert whole.returncode == 0 and "ledger OK: 60 events" in whole.stdout

    # An archived request is explained from the archive, once told where it is.
    unseen = waybill("explain", "m0r1")
    assert unseen.returncode == 1 and "archived: give their directory" in unseen.stderr
    explained = waybill("explain", "m0r1", "--json", "--archive", str(archive_dir))
    assert explained.returncode == 0, explained.stderr
    assert json.loads(explained.stdout)["request_id"] == "m0r1"
    live = waybill("explain", "m2r1", "--json")
    assert live.returncode == 0 and json.loads(live.stdout)["request_id"] == "m2r1"

    # The read models and the books are rebuilt and checked through the archive.
    refused = waybill("replay")
    assert refused.returncode == 1 and "give their directory (--archive" in refused.stderr
    replayed = waybill("replay", "--archive", str(archive_dir))
    assert replayed.returncode == 0, replayed.stderr
    assert "requests: rebuilt from 60 events" in replayed.stdout
    assert "books: rebuilt from 17 events" in replayed.stdout
    books = waybill("verify", "--books", "--archive", str(archive_dir))
    assert books.returncode == 0, books.stdout + books.stderr
    assert "books OK: 1 accounts and 9 holds" in books.stdout

    (archive_dir / f"ledger-{_SECOND}.jsonl.gz").unlink()
    missing = waybill("verify", "--archive", str(archive_dir), "--json")
    assert missing.returncode == 1 and "missing" in json.loads(missing.stdout)["problem"]


@pytest.mark.postgres
async def test_the_api_and_the_console_read_an_archived_request_in_the_archive(
    postgres_url: str, archive_dir: Path
) -> None:
    store, _ = await _three_months(postgres_url)
    try:
        await archive_months(store, date(_NOW.year, _NOW.month, 1), archive_dir)
        trail = await request_trail(store.engine, "m0r1", archive_dir)
        assert [e.version for e in trail] == list(range(1, len(trail) + 1))
        with pytest.raises(RequestArchived):
            await request_trail(store.engine, "m0r1", None)
        assert await request_trail(store.engine, "nowhere", None) == []  # not listed: no scan
    finally:
        await store.close()
        await store.engine.dispose()
    expected = explain(trail)
    routes = [Route("east")]
    async with running_gateway(postgres_url, ["east"], routes) as blind:
        admin = (await apikeys.create_key(blind.store, "acme", "admin")).secret
        async with blind.http() as http:
            said = await http.get("/v1/requests/m0r1/explain", headers=_bearer(admin))
            assert said.status_code == 404
            assert "archived month" in said.json()["error"]["message"]
            assert "WAYBILL_ARCHIVE_DIR" in said.json()["error"]["message"]
    async with running_gateway(postgres_url, ["east"], routes, archive_dir=archive_dir) as gw:
        async with gw.http() as http:
            explained = await http.get("/v1/requests/m0r1/explain", headers=_bearer(admin))
            assert explained.status_code == 200 and explained.json() == expected
            versions, cursor = [], None
            while True:  # paged two at a time, across the archive
                params = {"limit": "2", **({"cursor": cursor} if cursor else {})}
                page = await http.get(
                    "/v1/requests/m0r1/events", params=params, headers=_bearer(admin)
                )
                assert page.status_code == 200, page.text
                versions += [e["version"] for e in page.json()["data"]]
                cursor = page.json()["next_cursor"]
                if cursor is None:
                    break
            assert versions == [e.version for e in trail]
            live = await http.get("/v1/requests/m2r1/explain", headers=_bearer(admin))
            assert live.status_code == 200 and live.json()["request_id"] == "m2r1"
            unknown = await http.get("/v1/requests/nowhere/explain", headers=_bearer(admin))
            assert unknown.status_code == 404
            other = (await apikeys.create_key(gw.store, "other", "auditor")).secret
            hidden = await http.get("/v1/requests/m0r1/explain", headers=_bearer(other))
            assert hidden.status_code == 404  # another workspace's, archived or not
        async with browser(gw) as console:
            assert (await sign_in(console, admin)).status_code == 303
            page = await console.get("/console/requests/m0r1")
            assert page.status_code == 200 and "m0r1" in page.text


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_serve_refuses_an_archive_directory_that_is_not_one(
    sqlite_url: str, tmp_path: Path
) -> None:
    from router.fake_provider import FakeUpstream
    from tests.gateway.harness import ANTHROPIC_ENV, closed_port, config_text
    from tests.ledger.test_cli import waybill

    config = tmp_path / "waybill.yaml"
    with FakeUpstream("east") as east:
        config.write_text(config_text({"east": east}, [Route("east")]))
    missing = tmp_path / "no-such-archive"
    port = str(closed_port())
    result = waybill(
        "serve", "--config", str(config), "--archive", str(missing), "--port", port,
        database_url=sqlite_url, env=ANTHROPIC_ENV,
    )  # fmt: skip
    assert result.returncode == 1
    assert f"--archive: {missing} is not a directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.postgres
async def test_a_month_holding_a_period_adjustment_leaves_and_the_spend_report_keeps_it(
    postgres_url: str, archive_dir: Path
) -> None:
    store, _ = await _three_months(postgres_url, requests=2, adjusted=True)
    try:
        before = await spend_report(store.engine, group_by=["workspace"])
        assert before[0]["adjustment_settled_usd"] == "0.000500"
        segments = await archive_months(store, date(_NOW.year, _NOW.month, 1), archive_dir)
        assert [s.month for s in segments] == [_FIRST, _SECOND]
        assert await spend_report(store.engine, group_by=["workspace"]) == before
    finally:
        await store.close()
        await store.engine.dispose()


@pytest.mark.postgres
async def test_a_month_the_read_models_have_not_folded_stays(
    postgres_url: str, archive_dir: Path
) -> None:
    store, _ = await _three_months(postgres_url, requests=1, folded=False)
    try:
        first_of_this_month = date(_NOW.year, _NOW.month, 1)
        with pytest.raises(ArchiveRefused, match=r"\(keys, requests, spend\) have not yet folded"):
            await archive_months(store, first_of_this_month, archive_dir)
        assert await archived_segments(store.engine) == []
        await ProjectionRunner(store, all_projections()).catch_up()  # a gateway's follower
        assert len(await archive_months(store, first_of_this_month, archive_dir)) == 2
    finally:
        await store.close()
        await store.engine.dispose()
