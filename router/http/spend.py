"""Finance queries (contract §3): ``GET /v1/spend`` and ``GET /v1/settlements/unknown``.

Scoped like every read (:mod:`router.http.access`): admins see every workspace, finance and
auditors their workspace, a client its own key's spend. Money is a decimal string.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from datetime import date, datetime
from decimal import Decimal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from ledger.books.settlements import SettlementError, SettlementRefused, settle_unknown
from ledger.events import BudgetOverrun, UnknownUsageSettled
from ledger.store import EventStore
from ledger.types import MONEY_LIMIT, money_str, parse_money
from ledger.views.spend_queries import (
    GROUP_KEYS,
    SpendScope,
    budget_balances,
    spend_csv,
    spend_report,
    unknown_settlements_page,
)
from router.errors import (
    invalid_request,
    permission_denied,
    settlement_conflict,
    settlement_not_found,
)
from router.http import openapi as api_doc
from router.http.access import can_settle, spend_scope
from router.http.queries import decode_cursor, encode_cursor, limit_param
from router.request.gateway import Caller

__all__ = ["group_by_param", "parse_day", "settle_as", "spend_router"]

Authenticate = Callable[[Request], Awaitable[Caller]]


def spend_router(authenticate: Authenticate) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/spend", openapi_extra=api_doc.SPEND)
    async def spend(request: Request) -> Response:
        caller = await authenticate(request)
        params = request.query_params
        group_by = group_by_param(params.get("group_by", "workspace"))
        output = params.get("format", "json")
        if output not in ("json", "csv"):
            raise invalid_request(f"format must be json or csv, not {output!r}", param="format")
        rows = await spend_report(
            _store(request).engine,
            group_by=group_by,
            since=parse_day(params.get("since"), "since"),
            until=parse_day(params.get("until"), "until"),
            scope=_scope(caller, params),
        )
        if output == "csv":
            return Response(spend_csv(rows, group_by), media_type="text/csv; charset=utf-8")
        return Response(orjson.dumps({"data": rows, "next_cursor": None}), media_type=_JSON)

    @router.get("/v1/budgets", openapi_extra=api_doc.BUDGETS)
    async def budgets(request: Request) -> Response:
        """Account balances: limit, held, settled and available per key and workspace."""
        caller = await authenticate(request)
        rows = await budget_balances(
            _store(request).engine, scope=_scope(caller, request.query_params)
        )
        return Response(orjson.dumps({"data": rows, "next_cursor": None}), media_type=_JSON)

    @router.get("/v1/settlements/unknown", openapi_extra=api_doc.UNKNOWN_SETTLEMENTS)
    async def settlements(request: Request) -> Response:
        caller = await authenticate(request)
        params = request.query_params
        state = params.get("state")
        if state is not None and state not in ("open", "settled"):
            raise invalid_request(f"state must be open or settled, not {state!r}", param="state")
        page = await unknown_settlements_page(
            _store(request).engine,
            state=state,
            scope=_scope(caller, params),
            limit=limit_param(params),
            after=_settlement_cursor(params.get("cursor")),
        )
        next_cursor = None
        if page.next_after is not None:
            opened_at, settlement_id = page.next_after
            next_cursor = encode_cursor("settlements", [opened_at.isoformat(), settlement_id])
        return Response(
            orjson.dumps({"data": page.data, "next_cursor": next_cursor}), media_type=_JSON
        )

    @router.post("/v1/settlements/unknown/{settlement_id}", openapi_extra=api_doc.SETTLE_UNKNOWN)
    async def settle(settlement_id: str, request: Request) -> Response:
        """An operator settles unknown usage by hand: ``{"settled_usd", "reason"}``."""
        caller = await authenticate(request)
        if not can_settle(caller):
            raise permission_denied("settling unknown usage takes an admin or finance key")
        amount, reason, force = _settle_body(await request.body())
        event, overrun = await settle_as(
            caller, _store(request), settlement_id, amount, reason=reason, force=force
        )
        answer = event.model_dump(mode="json")
        answer["overrun_usd"] = money_str(overrun.excess_usd if overrun else Decimal(0))
        return Response(orjson.dumps(answer), media_type=_JSON)

    return router


_JSON = "application/json"


async def settle_as(
    caller: Caller,
    store: EventStore,
    settlement_id: str,
    amount: Decimal,
    *,
    reason: str,
    force: bool,
) -> tuple[UnknownUsageSettled, BudgetOverrun | None]:
    """Settle an open unknown-usage settlement by hand as ``caller`` (the API's route and the
    console's form): 403 for a role that may not settle, the same 404 for a settlement that
    does not exist as for one outside the caller's scope, 400 for an amount the books refuse,
    409 for one no longer open. Recorded with the caller's key id as the actor."""
    if not can_settle(caller):
        raise permission_denied("settling unknown usage takes an admin or finance key")
    page = await unknown_settlements_page(
        store.engine,
        state=None,
        scope=SpendScope(spend_scope(caller).workspace),
        limit=1,
        settlement_id=settlement_id,
    )
    if not page.data:
        raise settlement_not_found(settlement_id)
    try:
        return await settle_unknown(
            store, settlement_id, amount, actor=caller.key_id, reason=reason, force=force
        )
    except SettlementRefused as error:
        raise invalid_request(str(error), param="settled_usd") from None
    except SettlementError as error:
        raise settlement_conflict(str(error)) from None


def _settle_body(raw: bytes) -> tuple[Decimal, str, bool]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid_request("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise invalid_request("request body must be a JSON object")
    amount, reason = body.get("settled_usd"), body.get("reason")
    value = parse_money(amount) if isinstance(amount, str) else None
    if value is None:
        raise invalid_request(
            f"settled_usd must be a decimal string (0.25) below {MONEY_LIMIT}", param="settled_usd"
        )
    if not isinstance(reason, str) or not reason.strip():
        raise invalid_request("reason must say why (a non-empty string)", param="reason")
    force = body.get("force", False)
    if not isinstance(force, bool):
        raise invalid_request("force must be true or false", param="force")
    return value, reason.strip(), force


def _store(request: Request) -> EventStore:
    store: EventStore = request.app.state.store
    return store


def _scope(caller: Caller, params: Mapping[str, str]) -> SpendScope:
    return spend_scope(caller, params.get("workspace"))


def group_by_param(raw: str) -> list[str]:
    keys = [k.strip() for k in raw.split(",") if k.strip()]
    unknown = [k for k in keys if k not in GROUP_KEYS]
    if not keys or unknown or len(set(keys)) != len(keys):
        raise invalid_request(
            f"group_by must be a comma-separated subset of {', '.join(GROUP_KEYS)}",
            param="group_by",
        )
    return keys


def parse_day(raw: str | None, name: str) -> date | None:
    """The date a query parameter ``name`` gives (its first ten characters), None when absent;
    400 ``invalid_request`` naming it when it is no date (the API and the console alike)."""
    if raw is None:
        return None
    try:
        return date.fromisoformat(raw[:10])
    except ValueError:
        raise invalid_request(
            f"{name} must be a date (2026-11-30), not {raw!r}", param=name
        ) from None


def _settlement_cursor(cursor: str | None) -> tuple[datetime, str] | None:
    if cursor is None:
        return None
    values = decode_cursor("settlements", cursor)
    if len(values) != 2 or not all(isinstance(v, str) for v in values):
        raise invalid_request("cursor is not one this endpoint handed out", param="cursor")
    try:
        return datetime.fromisoformat(values[0]), values[1]
    except ValueError:
        raise invalid_request(
            "cursor is not one this endpoint handed out", param="cursor"
        ) from None
