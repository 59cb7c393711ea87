"""The console's pages of money: spend with its charts, budgets, unknown usage to settle,
and reconciliations to upload and read.

Settling and importing go through the functions the API's routes call
(``router.http.spend.settle_as``, ``router.http.reconcile.import_as``), so the rules, the
errors and the actor recorded are the API's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from starlette.datastructures import UploadFile

from ledger.finance.bucket_reconcile import bucket_json, find_bucket
from ledger.finance.provider_reports import REPORT_FORMATS
from ledger.finance.reconcile import list_reconciliations, report_json
from ledger.store import EventStore
from ledger.types import MONEY_LIMIT, money_str, parse_money
from ledger.views import all_projections
from ledger.views.explain import explain
from ledger.views.projection import ProjectionRunner
from ledger.views.queries import read_request_trails
from ledger.views.spend_queries import (
    budget_balances,
    routing_by_day,
    spend_csv,
    spend_report,
    unknown_settlements_page,
)
from router.errors import GatewayError, invalid_request, permission_denied, reconciliation_not_found
from router.http.access import can_reconcile, read_scope, spend_scope
from router.http.console.charts import Bar, bar_chart, line_chart
from router.http.console.keys import key_names_of
from router.http.console.web import PREFIX, Console, Visit, form_text, query_values
from router.http.queries import decode_cursor, encode_cursor
from router.http.reconcile import (
    MAX_EXPORT_BYTES,
    import_as,
    input_format_param,
    readable_reconciliation,
)
from router.http.spend import parse_day, settle_as

__all__ = ["add_money_pages"]

SPEND_GROUPS: Final = ("model", "endpoint", "workspace", "api")
DEFAULT_DAYS: Final = 30
SETTLEMENTS_PAGE: Final = 20
REPORTS_PAGE: Final = 20
_ZERO: Final = Decimal(0)


def add_money_pages(router: APIRouter, console: Console) -> None:
    async def spend(request: Request, visit: Visit) -> Response:
        return await _spend(console, request, visit)

    async def spend_download(request: Request, visit: Visit) -> Response:
        since, until, group, workspace = _spend_filters(request)
        rows = await spend_report(
            _store(request).engine,
            group_by=["day", group],
            since=since,
            until=until,
            scope=spend_scope(visit.caller, workspace),
        )
        return Response(
            spend_csv(rows, ["day", group]),
            media_type="text/csv; charset=utf-8",
            headers={
                "content-disposition": f'attachment; filename="spend-{since}-{until}-{group}.csv"'
            },
        )

    async def unknown(request: Request, visit: Visit) -> Response:
        return await _unknown(console, request, visit)

    async def settle(request: Request, visit: Visit) -> Response:
        settlement_id = request.path_params["settlement_id"]
        form = await request.form()
        try:
            amount = parse_money(form_text(form, "settled_usd") or "")
            if amount is None:
                raise invalid_request(
                    f"the amount must be a decimal number of dollars (0.25) below {MONEY_LIMIT}",
                    param="settled_usd",
                )
            reason = form_text(form, "reason")
            if reason is None:
                raise invalid_request("say why: the reason is recorded", param="reason")
            await settle_as(
                visit.caller,
                _store(request),
                settlement_id,
                amount,
                reason=reason,
                force=form.get("force") == "true",
            )
        except GatewayError as error:
            return await _unknown(
                console, request, visit, problem=(settlement_id, error), status=error.status
            )
        # The list the browser is sent back to reads the spend read model: bring it up to
        # the settlement first, so the settled one is gone from it.
        runner = ProjectionRunner(_store(request), all_projections())
        await runner.catch_up(runner.get("spend"))
        return RedirectResponse(f"{PREFIX}/unknown?settled={settlement_id}", status_code=303)

    async def reconciliations(request: Request, visit: Visit) -> Response:
        return await _reconciliations(console, request, visit)

    async def upload(request: Request, visit: Visit) -> Response:
        form = await request.form()
        try:
            if not can_reconcile(visit.caller):
                raise permission_denied("reconciliation takes an admin or finance key")
            export = form.get("export")
            if not isinstance(export, UploadFile):
                raise invalid_request("choose the provider's export to upload", param="export")
            data = await export.read(MAX_EXPORT_BYTES + 1)
            if len(data) > MAX_EXPORT_BYTES:
                raise invalid_request(f"usage export over {MAX_EXPORT_BYTES} bytes", status=413)
            if not data:
                raise invalid_request("the uploaded file is empty", param="export")
            report = await import_as(
                visit.caller,
                _store(request),
                console.serving_config(),
                data,
                provider=form_text(form, "provider"),
                named=input_format_param(form_text(form, "format")),
                content_type=export.content_type,
                force=form.get("force") == "true",
            )
        except GatewayError as error:
            return await _reconciliations(
                console, request, visit, problem=error, status=error.status
            )
        return RedirectResponse(
            f"{PREFIX}/reconciliations/{report.reconciliation_id}", status_code=303
        )

    async def report(request: Request, visit: Visit) -> Response:
        found = await readable_reconciliation(
            visit.caller, _store(request), request.path_params["reconciliation_id"]
        )
        return console.render(request, "report.html", visit, report=report_json(found))

    async def bucket(request: Request, visit: Visit) -> Response:
        reconciliation_id = request.path_params["reconciliation_id"]
        store = _store(request)
        found = await readable_reconciliation(visit.caller, store, reconciliation_id)
        asked = query_values(request, "model", "endpoint")
        comparisons = find_bucket(
            found,
            request.path_params["bucket"],
            model=asked["model"],
            endpoint=asked["endpoint"],
        )
        if not comparisons:
            raise reconciliation_not_found(reconciliation_id, request.path_params["bucket"])
        detail = await bucket_json(
            store, reconciliation_id, comparisons, read_scope(visit.caller).workspace
        )
        return console.render(
            request, "bucket.html", visit, reconciliation_id=reconciliation_id, detail=detail
        )

    console.route(router, "GET", "/spend", spend)
    console.route(router, "GET", "/spend.csv", spend_download)
    console.route(router, "GET", "/unknown", unknown)
    console.route(router, "POST", "/unknown/{settlement_id}/settle", settle)
    console.route(router, "GET", "/reconciliations", reconciliations)
    console.route(router, "POST", "/reconciliations", upload)
    console.route(router, "GET", "/reconciliations/{reconciliation_id}", report)
    console.route(router, "GET", "/reconciliations/{reconciliation_id}/buckets/{bucket}", bucket)


# --- spend ------------------------------------------------------------------------------


def _spend_filters(request: Request) -> tuple[date, date, str, str | None]:
    asked = query_values(request, "since", "until", "group", "workspace")
    until = parse_day(asked["until"], "until") or datetime.now(UTC).date()
    since = parse_day(asked["since"], "since") or until - timedelta(days=DEFAULT_DAYS - 1)
    group = asked["group"] or SPEND_GROUPS[0]
    if group not in SPEND_GROUPS:
        raise invalid_request(
            f"group must be one of {', '.join(SPEND_GROUPS)}, not {group!r}", param="group"
        )
    return since, until, group, asked["workspace"]


async def _spend(console: Console, request: Request, visit: Visit) -> Response:
    since, until, group, workspace = _spend_filters(request)
    scope = spend_scope(visit.caller, workspace)
    engine = _store(request).engine
    rows = await spend_report(
        engine, group_by=["day", group], since=since, until=until, scope=scope
    )
    routing = await routing_by_day(engine, since=since, until=until, scope=scope)
    cost: dict[str, Decimal] = {}
    for row in rows:
        cost[row["day"]] = cost.get(row["day"], _ZERO) + Decimal(row["settled_usd"])
    days = [d.isoformat() for d in _days(since, until)]
    requests = {r.day: r for r in routing}
    charts = {
        "cost": bar_chart(
            "settled cost per day (USD)",
            [Bar(d, cost.get(d, _ZERO), f"{d}: ${money_str(cost.get(d, _ZERO))}") for d in days],
            usd=True,
        ),
        "requests": bar_chart(
            "requests per day",
            [
                Bar(d, requests[d].requests if d in requests else 0, _requests_tip(d, requests))
                for d in days
            ],
        ),
        "failover": line_chart(
            "share of requests that failed over to another endpoint",
            [
                Bar(
                    d,
                    _rate(requests[d].failed_over, requests[d].requests),
                    _requests_tip(d, requests),
                )
                for d in days
                if d in requests
            ],
        ),
    }
    budgets = await budget_balances(engine, scope=scope, limit=100)
    config = console.serving_config()
    return console.render(
        request,
        "spend.html",
        visit,
        rows=rows,
        group=group,
        groups=SPEND_GROUPS,
        since=since.isoformat(),
        until=until.isoformat(),
        workspace=workspace or "",
        workspaces=[w.id for w in config.workspaces] if visit.caller.role == "admin" else [],
        charts=charts,
        totals=_totals(rows),
        budgets=budgets,
        key_names=await key_names_of(request, (b["key_id"] for b in budgets)),
    )


def _days(since: date, until: date) -> list[date]:
    count = max(0, min((until - since).days + 1, 3660))
    return [since + timedelta(days=i) for i in range(count)]


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _requests_tip(day: str, requests: Mapping[str, Any]) -> str:
    found = requests.get(day)
    if found is None:
        return f"{day}: no requests"
    return (
        f"{day}: {found.requests} requests, {found.failed_over} failed over "
        f"({_rate(found.failed_over, found.requests):.1%})"
    )


def _totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    columns = ("settled_usd", "held_unknown_usd", "overrun_usd")
    return {c: money_str(sum((Decimal(r[c]) for r in rows), _ZERO)) for c in columns}


# --- unknown usage ----------------------------------------------------------------------


async def _unknown(
    console: Console,
    request: Request,
    visit: Visit,
    *,
    problem: tuple[str, GatewayError] | None = None,
    status: int = 200,
) -> Response:
    asked = query_values(request, "workspace", "cursor", "settled")
    engine = _store(request).engine
    page = await unknown_settlements_page(
        engine,
        state="open",
        scope=spend_scope(visit.caller, asked["workspace"]),
        limit=SETTLEMENTS_PAGE,
        after=_settlement_cursor(asked["cursor"]),
    )
    trails = await read_request_trails(engine, [s["request_id"] for s in page.data])
    stories = {}
    for settlement in page.data:
        trail = trails.get(settlement["request_id"]) or []
        if not trail:
            continue
        explanation = explain(trail)
        attempt = next(
            (a for a in explanation["attempts"] if a["attempt_id"] == settlement["attempt_id"]),
            None,
        )
        stories[settlement["settlement_id"]] = {
            "summary": explanation["summary"],
            "attempt": attempt,
        }
    next_cursor = None
    if page.next_after is not None:
        opened_at, settlement_id = page.next_after
        next_cursor = encode_cursor("settlements", [opened_at.isoformat(), settlement_id])
    return console.render(
        request,
        "unknown.html",
        visit,
        status=status,
        settlements=page.data,
        stories=stories,
        next_cursor=next_cursor,
        paged=asked["cursor"] is not None,
        settled=asked["settled"],
        problem=problem,
        key_names=await key_names_of(request, (s["key_id"] for s in page.data)),
    )


def _settlement_cursor(cursor: str | None) -> tuple[datetime, str] | None:
    if cursor is None:
        return None
    values = decode_cursor("settlements", cursor)
    try:
        return datetime.fromisoformat(values[0]), str(values[1])
    except (ValueError, IndexError, TypeError):
        raise invalid_request("cursor is not one this page handed out", param="cursor") from None


# --- reconciliations --------------------------------------------------------------------


async def _reconciliations(
    console: Console,
    request: Request,
    visit: Visit,
    *,
    problem: GatewayError | None = None,
    status: int = 200,
) -> Response:
    if not can_reconcile(visit.caller):
        raise permission_denied("reconciliation takes an admin or finance key")
    before_raw = request.query_params.get("before")
    before = (
        int(before_raw) if before_raw and before_raw.isascii() and before_raw.isdigit() else None
    )
    found = await list_reconciliations(
        _store(request).engine,
        workspace=read_scope(visit.caller).workspace,
        limit=REPORTS_PAGE + 1,
        before=before,
    )
    more = len(found) > REPORTS_PAGE
    found = found[:REPORTS_PAGE]
    config = console.serving_config()
    return console.render(
        request,
        "reconciliations.html",
        visit,
        status=status,
        reports=found,
        before=str(found[-1].position) if more else None,
        paged=before is not None,
        problem=problem,
        providers=[e.id for e in config.endpoints],
        formats=("lines", *REPORT_FORMATS),
        admin=read_scope(visit.caller).workspace is None,
    )


def _store(request: Request) -> EventStore:
    store: EventStore = request.app.state.store
    return store
