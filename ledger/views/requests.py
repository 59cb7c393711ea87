"""The request view (contract §3): one row per request, folded from its events.

``status`` is ``in_progress`` until ``RequestCompleted`` (``succeeded``) or ``RequestFailed``
(``failed``, or ``partial_failure`` for a stream that broke after it started). ``endpoint``
is the endpoint of the attempt in flight while in progress, then the one that served the
request (or carried its broken stream); a failed request has none. Money: ``reserved_usd``
is every reservation made for the request, ``settled_usd`` what was settled, and
``held_unknown_usd`` what is still held as unknown usage.

``fold_request`` is the pure reducer, over the events' recorded fields
(``ledger.views.page.fields_of``); ``RequestViewProjection`` loads the rows a page of
events touches, folds the page in memory and writes each touched row once. Each row keeps
the position of the last event folded into it, which makes re-applying a page a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from ledger import events as ev
from ledger.store.schema import open_request_views, request_views
from ledger.views.page import PageEvent, fields_of
from ledger.views.projection import ModelWriter, Projection, fold_into

__all__ = ["RequestViewProjection", "fold_request"]

_ZERO = Decimal(0)

View = dict[str, Any]


def fold_request(view: View | None, recorded: PageEvent) -> View | None:
    """The request view after ``recorded``; None while the request is not known yet."""
    kind = recorded.type
    if kind == ev.RequestReceived.type:
        if view is not None:
            return view
        data = fields_of(recorded)
        return {
            "request_id": data["request_id"],
            "workspace": data["workspace"],
            "key_id": data["key_id"],
            "model": data["model_group"],
            "status": "in_progress",
            "endpoint": None,
            "upstream_model": None,
            "attempts": 0,
            "reserved_usd": _ZERO,
            "settled_usd": _ZERO,
            "held_unknown_usd": _ZERO,
            "http_status": None,
            "error_code": None,
            "input_tokens": None,
            "output_tokens": None,
            "duration_ms": None,
            "created_at": recorded.recorded_at,
            "completed_at": None,
            "last_position": recorded.position,
        }
    if view is None or recorded.position <= view["last_position"]:
        return view
    view = dict(view, last_position=recorded.position)
    data = fields_of(recorded)
    match kind:
        case ev.AttemptStarted.type:
            # While in progress, the endpoint is the one the latest attempt is bound to.
            view.update(
                attempts=max(view["attempts"], data["attempt_number"]),
                endpoint=data["endpoint"],
                upstream_model=data["model"],
            )
        case ev.BudgetReserved.type:
            view["reserved_usd"] += Decimal(data["amount_usd"])
        case ev.BudgetSettled.type:
            view["settled_usd"] += Decimal(data["settled_usd"])
        case ev.UnknownUsageOpened.type:
            view["held_unknown_usd"] += Decimal(data["held_usd"])
        case ev.UnknownUsageSettled.type:
            view["held_unknown_usd"] -= Decimal(data["held_usd"])
            view["settled_usd"] += Decimal(data["settled_usd"])
        case ev.RequestCompleted.type:
            usage = data["usage"]
            view.update(
                status="succeeded",
                endpoint=data["endpoint"],
                upstream_model=data["model"],
                http_status=data["http_status"],
                input_tokens=None if usage is None else usage["input_tokens"],
                output_tokens=None if usage is None else usage["output_tokens"],
                duration_ms=data["duration_ms"],
                completed_at=recorded.recorded_at,
            )
        case ev.RequestFailed.type:
            # A partial failure keeps the endpoint its stream was committed to; a failed
            # request was served by none.
            endpoint = data["endpoint"]
            committed = endpoint is not None and endpoint == view["endpoint"]
            view.update(
                status="partial_failure" if data["stream_started"] else "failed",
                endpoint=endpoint,
                upstream_model=view["upstream_model"] if committed else None,
                http_status=data["http_status"],
                error_code=data["error_code"],
                duration_ms=data["duration_ms"],
                completed_at=recorded.recorded_at,
            )
    return view


class RequestViewProjection(Projection):
    name = "requests"
    tables = (request_views, open_request_views)
    event_types = frozenset(
        {
            ev.RequestReceived.type,
            ev.AttemptStarted.type,
            ev.BudgetReserved.type,
            ev.BudgetSettled.type,
            ev.UnknownUsageOpened.type,
            ev.UnknownUsageSettled.type,
            ev.RequestCompleted.type,
            ev.RequestFailed.type,
        }
    )

    async def apply(self, writer: ModelWriter, batch: Sequence[PageEvent]) -> None:
        await fold_into(
            writer,
            request_views,
            "request_id",
            batch,
            fold_request,
            open_table=open_request_views,
            is_open=_in_progress,
        )


def _in_progress(view: View) -> bool:
    return bool(view["status"] == "in_progress")
