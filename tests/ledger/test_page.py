"""A page of the ledger as the read models read it (ledger.views.page): the recorded fields
they fold say what the typed events say, defaults and older schemas included."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import orjson
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from ledger import events as ev
from ledger.values import Usage
from ledger.views.page import DecodedEvent, decode, fields_of, with_defaults
from tests.ledger.factories import key_created, succeeded_trail, unknown_then_failed_trail

AT = datetime(2026, 12, 7, 9, 30, tzinfo=UTC)
IDS = {"request_id": "r1", "attempt_id": "r1-a1", "reservation_id": "r1-a1-r"}


def _more_events() -> list[ev.Event]:
    """The events the read models fold that the factories' trails leave out."""
    return [
        ev.RequestFailed(
            request_id="r1",
            http_status=502,
            error_code="stream_broken",
            error_type="upstream_error",
            message="the stream broke",
            attempts=2,
            endpoint="east",
            stream_started=True,
            duration_ms=80,
        ),
        ev.BudgetReleased(**IDS, released_usd=Decimal("0.0030"), reason="not_started"),
        ev.BudgetOverrun(
            **IDS,
            accounts=("key:k_1",),
            held_usd=Decimal("0.0030"),
            actual_usd=Decimal("0.0041"),
            excess_usd=Decimal("0.0011"),
            cause="usage_above_reservation",
        ),
        ev.UnknownUsageSettled(
            settlement_id="s1",
            **IDS,
            held_usd=Decimal("0.0050"),
            settled_usd=Decimal("0.0020"),
            released_usd=Decimal("0.0030"),
            source="operator",
            actor="k_admin",
            usage=ev.Usage(input_tokens=3, output_tokens=4, cached_input_tokens=1),
        ),
        ev.PeriodAdjusted(
            period="2026-11",
            in_period="2026-12",
            **IDS,
            workspace="acme",
            cause="operator_settlement",
            settled_usd=Decimal("-0.0010"),
            held_unknown_usd=Decimal("0.0005"),
            overrun_usd=Decimal(0),
        ),
        ev.BudgetReserved(
            **IDS,
            amount_usd=Decimal("0.000001"),
            accounts=(),
            endpoint="east",
            model="m",
            workspace="acme",
            key_id="k_1",
            model_group="chat",
            api="anthropic.messages",
        ),
    ]


def _recorded(event: ev.Event, position: int = 1) -> DecodedEvent:
    """``event`` as a page decodes it from the bytes the ledger records."""
    payload = orjson.dumps(
        {
            "data": ev.encode_event(event),
            "metadata": {},
            "recorded_at": AT.isoformat(),
            "schema_version": event.schema_version,
            "stream_id": "request-r1",
            "type": event.type,
            "version": 1,
        },
        option=orjson.OPT_SORT_KEYS,
    )
    return decode(position, payload)


def _agrees(typed: Any, recorded: Any) -> bool:
    """Whether a recorded field (JSON values, defaults left out) says what the typed field
    does, records and tuples of them compared field by field."""
    if isinstance(typed, BaseModel):
        fields = with_defaults(type(typed), recorded)
        return all(_agrees(getattr(typed, name), fields[name]) for name in type(typed).model_fields)
    if isinstance(typed, tuple):
        return len(typed) == len(recorded) and all(map(_agrees, typed, recorded))
    return bool(to_jsonable_python(typed) == recorded)


def test_the_recorded_fields_say_what_the_typed_event_says() -> None:
    trails = succeeded_trail("r1") + unknown_then_failed_trail("r2") + [key_created()]
    for event in trails + _more_events():
        recorded = _recorded(event)
        fields = fields_of(recorded)
        assert set(fields) == set(type(event).model_fields), event.type
        assert _agrees(event, fields), event.type
        assert recorded.event() == event


def test_a_field_recorded_before_it_existed_reads_as_the_models_default() -> None:
    old = DecodedEvent(
        7,
        ev.BudgetReserved.type,
        1,
        {**IDS, "amount_usd": "0.1", "accounts": [], "endpoint": "east", "model": "m"},
        AT,
    )
    fields = fields_of(old)
    assert fields["api"] == "openai.chat_completions" and fields["workspace"] is None
    usage = with_defaults(Usage, {"input_tokens": 1, "output_tokens": 2})
    assert usage["cached_input_tokens"] == 0 and usage["web_searches"] == 0


def test_an_event_of_an_older_schema_reads_upcast() -> None:
    secret = hashlib.sha256(b"k").hexdigest()
    data = {"key_id": "k_1", "workspace": "acme", "role": "client", "secret_sha256": secret}
    old = DecodedEvent(3, ev.KeyCreated.type, 1, {**data, "label": "ci"}, AT)
    fields = fields_of(old)
    assert fields["name"] == "ci" and "label" not in fields
    assert fields == old.event().model_dump(mode="json")
