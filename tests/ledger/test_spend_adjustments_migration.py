"""Migration 0013 on a ledger that holds period adjustments: the spend rows get the sums of
those the spend read model had folded, the rest it folds itself; and back."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal

import pytest
import sqlalchemy as sa
from alembic import command

from ledger import events as ev
from ledger.store import ANY_VERSION, EventStore
from ledger.store.db import _alembic_config, create_engine, migrate, sync_url
from ledger.types import MoneyColumn

D = Decimal
_COLUMNS = ("adjustment_settled_usd", "adjustment_held_unknown_usd", "adjustment_overrun_usd")
_ROWS = sa.table(
    "spend_attempts",
    *(sa.column(c) for c in ("reservation_id", "request_id", "attempt_id", "workspace")),
    *(sa.column(c) for c in ("key_id", "model_group", "endpoint", "model", "day", "state")),
    *(sa.column(c, MoneyColumn) for c in ("reserved_usd", "settled_usd", "held_unknown_usd")),
    sa.column("overrun_usd", MoneyColumn),
    sa.column("reserved_at", sa.DateTime(timezone=True)),
    sa.column("last_position", sa.BigInteger),
)


@pytest.fixture
def engine(empty_database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(sync_url(empty_database_url))
    yield engine
    engine.dispose()


def _adjusted(n: int, settled: str, overrun: str = "0") -> ev.PeriodAdjusted:
    return ev.PeriodAdjusted(
        period="2026-10",
        in_period="2026-11",
        request_id=f"r{n}",
        attempt_id=f"r{n}-a1",
        reservation_id=f"r{n}-a1-r",
        workspace="acme",
        cause="operator_settlement",
        settled_usd=D(settled),
        held_unknown_usd=D(0),
        overrun_usd=D(overrun),
    )


async def _append(url: str, events: list[ev.Event]) -> int:
    store = EventStore(create_engine(url))
    try:
        recorded = await store.append("period-2026-11", ANY_VERSION, events)
        return recorded[-1].position
    finally:
        await store.close()
        await store.engine.dispose()


async def test_spend_rows_get_the_adjustments_the_read_model_had_folded(
    empty_database_url: str, engine: sa.Engine
) -> None:
    url = empty_database_url
    migrate(url)  # the events are appended by this code, then the schema goes back
    folded = await _append(url, [_adjusted(1, "0.25"), _adjusted(2, "0.5", "0.1")])
    await _append(url, [_adjusted(1, "0.05")])  # after the read model's checkpoint
    command.downgrade(_alembic_config(url), "0012")
    with engine.begin() as conn:
        for n in (1, 2, 3):
            conn.execute(
                _ROWS.insert().values(
                    reservation_id=f"r{n}-a1-r", request_id=f"r{n}", attempt_id=f"r{n}-a1",
                    workspace="acme", key_id="k_1", model_group="chat", endpoint="east",
                    model="m", day="2026-10-31", state="settled", reserved_usd=D("1"),
                    settled_usd=D("0.5"), held_unknown_usd=D(0), overrun_usd=D(0),
                    reserved_at=datetime(2026, 10, 31, tzinfo=UTC), last_position=1,
                )
            )  # fmt: skip
        conn.execute(
            sa.text(
                "INSERT INTO projection_checkpoints (name, position, updated_at) "
                "VALUES ('spend', :position, :now)"
            ),
            {"position": folded, "now": datetime.now(UTC)},
        )
    migrate(url)
    table = sa.table(
        "spend_attempts",
        sa.column("reservation_id"),
        *(sa.column(c, MoneyColumn) for c in _COLUMNS),
    )
    with engine.connect() as conn:
        rows = conn.execute(sa.select(table).order_by(sa.text("reservation_id"))).all()
    assert [tuple(row) for row in rows] == [
        ("r1-a1-r", D("0.25"), D(0), D(0)),  # the later 0.05 is the read model's to fold
        ("r2-a1-r", D("0.5"), D(0), D("0.1")),
        ("r3-a1-r", None, None, None),  # none moved it
    ]
    command.downgrade(_alembic_config(url), "0012")
    with engine.connect() as conn:
        names = {c["name"] for c in sa.inspect(conn).get_columns("spend_attempts")}
    assert not names & set(_COLUMNS)
