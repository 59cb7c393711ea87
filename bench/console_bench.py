"""Console benchmark: each page's time on a ledger of a million requests, and the plan of
every query a page runs.

    .venv/bin/python bench/console_bench.py [--requests 1000000] [--runs 5] [--keep] [--json]
        [--database console_bench]

On a fresh PostgreSQL database (``--database``, ``console_bench`` unless given; dropped at the
end unless ``--keep``):

1. 50 reconciliations are recorded through the store, and the gateway (in this process, two
   fake providers) serves a few real requests: a failover, an unknown usage then a failover,
   a request failed on both endpoints, then plain successes. Their trails are what the
   request pages explain, and what the synthetic requests copy;
2. the read models the console pages through are filled with ``--requests`` synthetic
   requests in SQL (``generate_series``): request views over 90 days in 20 workspaces and
   200 keys, one spend row per attempt (2% fail on both endpoints, 1% have an unknown usage
   on their first attempt, a third of those still open, and 7% more fail over: two
   attempts), workspace budget months, key budget days, one request account per request of
   a fifth of them. Each synthetic request's ``appends`` rows are a copy of the real trail
   of its kind with its own ids and times, chained and encoded by the store's own functions
   (``chain_hash``, ``row_of``) and copied in (``COPY``), so that ``waybill verify`` passes;
   the head and the read models' checkpoints are moved past them, so no follower reads them
   again, then ``ANALYZE``;
3. a signed-in browser session (an admin, then a workspace's finance key) fetches each page
   ``--runs`` times: the median and the slowest are printed;
4. every statement a page sent through the app's SQLAlchemy engine is explained with its own
   parameters; a sequential scan of one of the large tables is reported (``seq scans``),
   and the run exits 1. (A session's key check goes through the asyncpg pool: one primary
   key read, not explained here.)

A benchmark, not a test: the times depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import uvicorn
from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.databases import PG_ADMIN, fresh_postgres
from ledger import apikeys
from ledger import events as ev
from ledger.store import EventStore
from ledger.store.db import create_engine, migrate
from ledger.store.partitions import month_of, next_month, partition_sql
from ledger.store.stored import chain_hash, payloads_of, row_of, types_of
from ledger.views import all_projections
from router.config import parse_config
from router.fake_provider import Behavior, FakeUpstream
from router.http.app import AppSettings, create_app
from router.serving.server import UVICORN_OPTIONS

DATABASE = "console_bench"
LARGE_TABLES = (
    "request_views",
    "spend_attempts",
    "unknown_settlements",
    "budget_accounts",
    "appends",
)
SMALL = 10_000
BODY = {"model": "group-0", "messages": [{"role": "user", "content": "hi"}]}


def _config(primary: str, fallback: str) -> str:
    endpoints = [
        f'  - {{id: ep-0, driver: openai, base_url: "{primary}", region: r, '
        f"data_classes: [public, internal], proxy: none}}",
        f'  - {{id: ep-1, driver: openai, base_url: "{fallback}", region: r, '
        f"data_classes: [public, internal], proxy: none}}",
    ]
    endpoints += [
        f'  - {{id: ep-{i}, driver: openai, base_url: "http://127.0.0.1:9/v1", region: r, '
        f"data_classes: [public, internal], proxy: none}}"
        for i in range(2, 6)
    ]
    groups = []
    for g in range(4):
        first, second = (0, 1) if g == 0 else (2 + g % 4, 2 + (g + 1) % 4)
        groups.append(
            f"  - name: group-{g}\n    mappings:\n"
            + "".join(
                f"      - {{endpoint: ep-{e}, model: m-{e}, tier: {tier}, weight: 1, "
                "capabilities: [text, stream], context_window: 128000, max_output_tokens: 4096, "
                "price: {input_per_mtok: 1.0, output_per_mtok: 2.0}}\n"
                for tier, e in enumerate((first, second))
            )
        )
    workspaces = [
        f"  - {{id: ws_{w:02d}, models: [group-0, group-1, group-2, group-3], regions: [r], "
        "data_class: internal, budget: {limit_usd: 100000, window: month}}"
        for w in range(20)
    ]
    return (
        "generation: console-bench\ndefaults:\n"
        "  retry_same_endpoint: {rate_limited: {max: 0}, upstream_unavailable: {max: 0}}\n"
        "  breaker: {failure_threshold: 5, base_cooldown_ms: 10, max_cooldown_ms: 20}\n"
        "endpoints:\n"
        + "\n".join(endpoints)
        + "\nmodels:\n"
        + "".join(groups)
        + "workspaces:\n"
        + "\n".join(workspaces)
        + "\n"
    )


# Which synthetic requests are which (the SQL below and `_trail_kind` agree): every 50th
# (from the 25th) fails on both endpoints, every 100th has an unknown usage on its first
# attempt and succeeds on its second (a third of them still open), every 13th fails over.
_TWO = "(i % 13 = 0 OR i % 100 = 0 OR i % 50 = 25)"
_FILL = """
INSERT INTO request_views (request_id, workspace, key_id, model, status, endpoint,
    upstream_model, attempts, reserved_usd, settled_usd, held_unknown_usd, http_status,
    error_code, input_tokens, output_tokens, duration_ms, created_at, completed_at,
    last_position)
SELECT 'req_' || lpad(i::text, 28, '0'), 'ws_' || lpad((i % 20)::text, 2, '0'),
       'key_' || lpad((i % 200)::text, 16, '0'), 'group-' || (i % 4),
       CASE WHEN i % 50 = 25 THEN 'failed' ELSE 'succeeded' END,
       'ep-' || (i % 6), 'm-' || (i % 6), CASE WHEN TWO THEN 2 ELSE 1 END,
       CASE WHEN TWO THEN 0.004 ELSE 0.002 END,
       CASE WHEN i % 50 = 25 THEN 0 ELSE 0.0011 END,
       CASE WHEN i % 300 = 0 THEN 0.002 ELSE 0 END,
       CASE WHEN i % 50 = 25 THEN 429 ELSE 200 END,
       CASE WHEN i % 50 = 25 THEN 'upstream_rate_limited' END,
       CASE WHEN i % 50 = 25 THEN NULL ELSE 120 END,
       CASE WHEN i % 50 = 25 THEN NULL ELSE 40 END,
       800, ts, ts + interval '800 milliseconds', 0
FROM (SELECT i, now() - interval '90 days' * (1 - i::float / %(n)s) AS ts
      FROM generate_series(1, %(n)s) AS i) AS r;

INSERT INTO spend_attempts (reservation_id, request_id, attempt_id, workspace, key_id,
    model_group, endpoint, model, api, day, state, reserved_usd, settled_usd,
    held_unknown_usd, overrun_usd, reserved_at, upstream_request_id, response_id,
    input_tokens, output_tokens, cached_input_tokens, last_position)
SELECT 'res_' || lpad(i::text, 26, '0') || '_' || a, 'req_' || lpad(i::text, 28, '0'),
       'att_' || lpad(i::text, 26, '0') || '_' || a, 'ws_' || lpad((i % 20)::text, 2, '0'),
       'key_' || lpad((i % 200)::text, 16, '0'), 'group-' || (i % 4), 'ep-' || ((i + a) % 6),
       'm-' || ((i + a) % 6), 'openai.chat_completions', to_char(ts, 'YYYY-MM-DD'), state,
       0.002, CASE WHEN state IN ('settled', 'unknown_settled') THEN 0.0011 ELSE 0 END,
       CASE WHEN state = 'unknown' THEN 0.002 ELSE 0 END, 0, ts,
       'up_ep-' || ((i + a) % 6) || '_' || lpad(i::text, 10, '0') || '_' || a,
       CASE WHEN state = 'settled'
            THEN 'chatcmpl-ep-' || ((i + a) % 6) || '_' || lpad(i::text, 10, '0') END,
       CASE WHEN state = 'settled' THEN 120 END, CASE WHEN state = 'settled' THEN 40 END,
       CASE WHEN state = 'settled' THEN 0 END, 0
FROM (SELECT i, a, ts,
             CASE WHEN i % 300 = 0 AND a = 1 THEN 'unknown'
                  WHEN i % 100 = 0 AND a = 1 THEN 'unknown_settled'
                  WHEN i % 50 = 25 OR (a = 1 AND TWO) THEN 'released'
                  ELSE 'settled' END AS state
      FROM (SELECT i, now() - interval '90 days' * (1 - i::float / %(n)s) AS ts
            FROM generate_series(1, %(n)s) AS i) AS r
      CROSS JOIN LATERAL generate_series(1, CASE WHEN TWO THEN 2 ELSE 1 END) AS a) AS s;

INSERT INTO unknown_settlements (settlement_id, request_id, attempt_id, reservation_id,
    workspace, key_id, endpoint, model, cause, held_usd, state, settled_usd, opened_at,
    settled_at, last_position)
SELECT 'unk_' || lpad(i::text, 26, '0') || '_1', 'req_' || lpad(i::text, 28, '0'),
       'att_' || lpad(i::text, 26, '0') || '_1', 'res_' || lpad(i::text, 26, '0') || '_1',
       'ws_' || lpad((i % 20)::text, 2, '0'), 'key_' || lpad((i % 200)::text, 16, '0'),
       'ep-' || ((i + 1) % 6), 'm-' || ((i + 1) % 6), 'upstream_unavailable', 0.002,
       CASE WHEN i % 300 = 0 THEN 'open' ELSE 'settled' END,
       CASE WHEN i % 300 = 0 THEN NULL ELSE 0.0011 END, ts,
       CASE WHEN i % 300 = 0 THEN NULL ELSE ts + interval '1 day' END, 0
FROM (SELECT i, now() - interval '90 days' * (1 - i::float / %(n)s) AS ts
      FROM generate_series(100, %(n)s, 100) AS i) AS r;

INSERT INTO budget_accounts (account_id, kind, workspace, key_id, window_start, limit_usd,
    held_usd, settled_usd, overrun_usd, updated_at)
SELECT 'workspace:ws_' || lpad(w::text, 2, '0') || ':' || m, 'workspace',
       'ws_' || lpad(w::text, 2, '0'), NULL, m, 100000, 0, 55.0, 0, now()
FROM generate_series(0, 19) AS w,
     LATERAL (SELECT DISTINCT to_char(now() - interval '1 day' * x, 'YYYY-MM-01') AS m
              FROM generate_series(1, 90) AS x) AS months
ON CONFLICT (account_id) DO NOTHING;
INSERT INTO budget_accounts (account_id, kind, workspace, key_id, window_start, limit_usd,
    held_usd, settled_usd, overrun_usd, updated_at)
SELECT 'key:key_' || lpad(k::text, 16, '0') || ':' || d, 'key',
       'ws_' || lpad((k % 20)::text, 2, '0'),
       'key_' || lpad(k::text, 16, '0'), d, 50, 0, 11.5, 0, now()
FROM generate_series(0, 199) AS k,
     LATERAL (SELECT to_char(now() - interval '1 day' * x, 'YYYY-MM-DD') AS d
              FROM generate_series(0, 89) AS x) AS days;
INSERT INTO budget_accounts (account_id, kind, workspace, key_id, window_start, limit_usd,
    held_usd, settled_usd, overrun_usd, updated_at)
SELECT 'request:req_' || lpad(i::text, 28, '0'), 'request', 'ws_' || lpad((i % 20)::text, 2, '0'),
       NULL, NULL, 0.01, 0, 0.0011, 0, now()
FROM generate_series(5, %(n)s, 5) AS i;
""".replace("TWO", _TWO)


def _trail_kind(i: int) -> str:
    """Which real request's trail synthetic request ``i``'s appends copy (as ``_FILL``)."""
    if i % 50 == 25:
        return "failed"
    if i % 100 == 0:
        return "unknown"
    if i % 13 == 0:
        return "failover"
    return "succeeded"


@dataclass
class Trail:
    """A real request's appends, to copy: each row's stream, version, types, time after the
    first row and canonical payloads, with the strings a copy replaces."""

    rows: list[tuple[str, int, list[str], timedelta, list[bytes]]]
    request_suffix: str
    attempt_suffixes: list[str]
    key_id: str
    stamps: list[bytes]  # each row's recorded_at as its payloads hold it (JSON)


def read_trail(conn: psycopg.Connection[Any], request_id: str) -> Trail:
    """``request_id``'s stream as the gateway wrote it."""
    rows = []
    stamps = []
    found = conn.execute(
        "SELECT version, types, recorded_at, payloads FROM appends WHERE stream_id = %s "
        "ORDER BY version",
        (f"request-{request_id}",),
    ).fetchall()
    first = found[0][2]
    for version, types, recorded_at, payloads in found:
        events = payloads_of(bytes(payloads))
        stamps.append(orjson.dumps(orjson.loads(events[0])["recorded_at"]))
        rows.append(
            (f"request-{request_id}", version, types_of(types), recorded_at - first, events)
        )
    attempts = conn.execute(
        "SELECT attempt_id FROM spend_attempts WHERE request_id = %s ORDER BY reserved_at",
        (request_id,),
    ).fetchall()
    key = conn.execute(
        "SELECT key_id FROM request_views WHERE request_id = %s", (request_id,)
    ).fetchone()
    assert key is not None and attempts, request_id
    return Trail(
        rows,
        request_id.removeprefix("req_"),
        [str(a[0]).removeprefix("att_") for a in attempts],
        str(key[0]),
        stamps,
    )


def fill_appends(
    conn: psycopg.Connection[Any],
    trails: dict[str, Trail],
    requests: int,
    position: int,
    previous: str,
    now: datetime,
) -> tuple[int, str]:
    """Each synthetic request's appends, copied from a real trail of its kind with its own
    ids and times, chained on from ``position`` (the head) and ``previous`` (its hash) and
    encoded by the store's own functions (``row_of``); returns the new head and its hash."""
    span = timedelta(days=90)
    months, month = [month_of(now - span)], month_of(now)
    while months[-1] != month:
        months.append(next_month(months[-1]))
    for month in months:
        for statement in partition_sql(month):
            conn.execute(statement)
    columns = ("position", "recorded_at", "version", "stream_id", "types", "hash", "payloads")
    with conn.cursor().copy(f"COPY appends ({', '.join(columns)}) FROM STDIN") as copy:
        for i in range(1, requests + 1):
            trail = trails[_trail_kind(i)]
            moment = now - span * (1 - i / requests)
            swaps = [
                (trail.request_suffix.encode(), f"{i:028d}".encode()),
                (trail.key_id.encode(), f"key_{i % 200:016d}".encode()),
                (b'"ws_00"', f'"ws_{i % 20:02d}"'.encode()),
            ] + [
                (suffix.encode(), f"{i:026d}_{a}".encode())
                for a, suffix in enumerate(trail.attempt_suffixes, 1)
            ]
            for (stream, version, types, offset, template), stamp in zip(
                trail.rows, trail.stamps, strict=True
            ):
                recorded_at = moment + offset
                swapped = [*swaps, (stamp, orjson.dumps(recorded_at.isoformat()))]
                payloads, hashes = [], []
                for event in template:
                    for old, new in swapped:
                        event = event.replace(old, new)
                    position += 1
                    previous = chain_hash(previous, position, event)
                    payloads.append(event)
                    hashes.append(previous)
                row = row_of(
                    position - len(payloads) + 1,
                    stream.replace(trail.request_suffix, f"{i:028d}"),
                    version,
                    types,
                    recorded_at,
                    bytes.fromhex(hashes[-1]),
                    payloads,
                )
                copy.write_row([row[c] for c in columns])
    return position, previous


@dataclass
class Page:
    name: str
    path: str
    times_ms: list[float] = field(default_factory=list)
    statements: int = 0
    seq_scans: list[str] = field(default_factory=list)


@contextmanager
def captured(engine: Any) -> Iterator[list[tuple[str, Any]]]:
    """Every statement the engine sends while the block runs, with its parameters."""
    seen: list[tuple[str, Any]] = []

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            seen.append((statement, parameters))

    event.listen(engine.sync_engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", before)


def seq_scans(url: str, statements: list[tuple[str, Any]]) -> list[str]:
    """The large tables a sequential scan reads in the plans of these statements. A
    partitioned table's scans name its partitions (``appends_2026_12``); one of a partition
    with fewer than ``SMALL`` rows (the next month's, still empty) is no finding."""
    found = []
    tables = "|".join(LARGE_TABLES)
    with psycopg.connect(url) as conn:
        conn.execute("SET plan_cache_mode = force_custom_plan")
        for statement, parameters in statements:
            plan = "\n".join(
                row[0] for row in conn.execute(f"EXPLAIN {statement}", parameters).fetchall()
            )
            scanned = set(re.findall(rf"Seq Scan on ((?:{tables})(?:_\d{{4}}_\d{{2}})?)\b", plan))
            for table in sorted(scanned):
                rows = conn.execute(
                    "SELECT reltuples FROM pg_class WHERE relname = %s", (table,)
                ).fetchone()
                if rows is None or rows[0] >= SMALL:
                    found.append(f"{table}: {statement.split(chr(10))[0][:90]}")
    return found


async def _serve(
    settings: AppSettings,
) -> tuple[uvicorn.Server, asyncio.Task[None], str, Any]:
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, **UVICORN_OPTIONS))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no event to await
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, task, f"http://127.0.0.1:{port}", app


async def _sign_in(http: httpx.AsyncClient, secret: str) -> None:
    http.cookies.clear()
    form = await http.get("/console/sign-in")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
    assert token
    signed = await http.post("/console/sign-in", data={"api_key": secret, "csrf_token": token[1]})
    assert signed.status_code == 303, signed.text


async def run(
    requests: int, runs: int, keep: bool, database: str = DATABASE
) -> tuple[list[Page], dict[str, Any]]:
    url = fresh_postgres(database)
    database_url = url.replace("postgresql://", "postgresql+psycopg://", 1)
    migrate(database_url)
    engine = create_engine(database_url)
    store = EventStore(engine)
    admin = await apikeys.create_key(store, "ws_00", "admin")
    finance = await apikeys.create_key(store, "ws_03", "finance")
    client = await apikeys.create_key(store, "ws_00", "client")
    for i in range(50):  # through the store: the reconciliations page reads their events
        report = ev.ReconciliationImported(
            reconciliation_id=f"rec_{i:024d}",
            workspace=f"ws_{i % 20:02d}",
            file_sha256="0" * 64,
            lines=1000,
            imported_by=finance.key_id,
        )
        await store.append(f"reconciliation-{report.reconciliation_id}", 0, [report])
    async with FakeUpstream("ep-0") as primary, FakeUpstream("ep-1") as fallback:
        config = parse_config(_config(primary.base_url, fallback.base_url))
        settings = AppSettings(config, database_url)
        server, task, base, _ = await _serve(settings)
        # The trails the synthetic requests copy: a failover, an unknown usage then a
        # failover, a request failed on both endpoints, then plain successes.
        primary.set_plan(
            [Behavior.rate_limited(), Behavior.server_error(), Behavior.rate_limited()]
            + [Behavior.ok()] * 7
        )
        fallback.set_plan([Behavior.ok(), Behavior.ok(), Behavior.rate_limited()])
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            ids = []
            for _ in range(10):
                answer = await http.post(
                    "/v1/chat/completions",
                    json=BODY,
                    headers={"Authorization": f"Bearer {client.secret}"},
                )
                ids.append(answer.headers["x-request-id"])
                await asyncio.sleep(0.05)
        await asyncio.sleep(1)
        server.should_exit = True
        await task

        started = time.perf_counter()
        with psycopg.connect(url, autocommit=True) as conn:
            kinds = ("failover", "unknown", "failed", "succeeded")
            trails = {kind: read_trail(conn, ids[n]) for n, kind in enumerate(kinds)}
            head = conn.execute("SELECT position, hash FROM ledger_head").fetchone()
            assert head is not None
            # Integers only, put in the text: several statements go in one simple query.
            conn.execute(_FILL.replace("%(n)s", str(int(requests))))
            with conn.transaction():
                last, last_hash = fill_appends(
                    conn, trails, requests, int(head[0]), str(head[1]), datetime.now(UTC)
                )
            conn.execute("UPDATE ledger_head SET position = %s, hash = %s", (last, last_hash))
            # The synthetic rows are no one's to project again (the read models hold them).
            conn.execute(
                "INSERT INTO projection_checkpoints (name, position, updated_at) "
                "SELECT n, %s, now() FROM unnest(%s::text[]) AS n "
                "ON CONFLICT (name) DO UPDATE SET position = EXCLUDED.position",
                (last, [p.name for p in all_projections()]),
            )
            conn.execute("ANALYZE")
        fill_s = time.perf_counter() - started

        server, task, base, app = await _serve(settings)
        served_engine = app.app.state.store.engine
        pages = [
            Page("requests, newest first (admin)", "/console/requests"),
            Page("requests, failed only", "/console/requests?status=failed"),
            Page("requests, one key", "/console/requests?key_id=key_0000000000000042"),
            Page(
                "requests, one endpoint and a day",
                "/console/requests?endpoint=ep-3&since=2026-01-01&until=2099-01-01",
            ),
            Page("a request's timeline", f"/console/requests/{ids[0]}"),
            Page("spend, 30 days by model group (admin)", "/console/spend"),
            Page("spend, 30 days by endpoint", "/console/spend?group=endpoint"),
            Page("unknown usage, oldest open (admin)", "/console/unknown"),
            Page("reconciliations (admin)", "/console/reconciliations"),
            Page("health (admin)", "/console/health"),
        ]
        finance_pages = [
            Page("requests of a workspace (finance)", "/console/requests"),
            Page("spend of a workspace (finance)", "/console/spend"),
            Page("unknown usage of a workspace (finance)", "/console/unknown"),
        ]
        try:
            async with httpx.AsyncClient(base_url=base, timeout=120) as http:
                for secret, group in ((admin.secret, pages), (finance.secret, finance_pages)):
                    await _sign_in(http, secret)
                    for page in group:
                        second = None
                        for i in range(runs + 1):
                            with captured(served_engine) as statements:
                                begun = time.perf_counter()
                                answer = await http.get(page.path)
                                elapsed = (time.perf_counter() - begun) * 1000
                            assert answer.status_code == 200, (page.path, answer.status_code)
                            if i == 0:
                                second = answer.text  # the first run warms the caches
                                page.statements = len(statements)
                                page.seq_scans = seq_scans(url, statements)
                            else:
                                page.times_ms.append(elapsed)
                        if page.path == "/console/requests?status=failed" and second:
                            cursor = re.search(r'href="([^"]*cursor=[^"]+)"', second)
                            if cursor:
                                group.append(
                                    Page("requests, a later page", cursor[1].replace("&amp;", "&"))
                                )
        finally:
            server.should_exit = True
            await task
            await store.close()
            await engine.dispose()
    if not keep:
        with psycopg.connect(
            PG_ADMIN.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
        ) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
    return pages + finance_pages, {"requests": requests, "fill_s": round(fill_s, 1), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--database", default=DATABASE, help="the database's name")
    arguments = parser.parse_args()
    pages, facts = asyncio.run(
        run(arguments.requests, arguments.runs, arguments.keep, arguments.database)
    )
    if arguments.json:
        print(json.dumps({**facts, "pages": [p.__dict__ for p in pages]}, indent=2))
    else:
        print(
            f"{facts['requests']:,} requests filled in {facts['fill_s']} s; "
            f"{facts['runs']} runs a page"
        )
        print(f"{'page':44} {'median ms':>10} {'max ms':>8} {'queries':>8}  seq scans")
        for p in pages:
            print(
                f"{p.name:44} {statistics.median(p.times_ms):10.1f} {max(p.times_ms):8.1f} "
                f"{p.statements:8d}  {'; '.join(p.seq_scans) or 'none'}"
            )
    if any(p.seq_scans for p in pages):
        sys.exit(1)


if __name__ == "__main__":
    main()
