"""Migration 0014 on books that hold holds in every state: the open ones get their row in
``budget_open_holds``, the hold rows lose their state and owner, and back."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal

import pytest
import sqlalchemy as sa
from alembic import command

from ledger.books.balances import holds
from ledger.store.db import _alembic_config, migrate, sync_url
from ledger.store.schema import budget_holds
from ledger.types import MoneyColumn

_HOLDS = sa.table(
    "budget_holds",
    *(sa.column(c) for c in ("reservation_id", "request_id", "attempt_id", "workspace")),
    *(sa.column(c) for c in ("key_id", "endpoint", "model", "accounts", "state", "owner")),
    sa.column("amount_usd", MoneyColumn),
    sa.column("created_at", sa.DateTime(timezone=True)),
)
_STATES = {"r1": "held", "r2": "unknown", "r3": "resolved"}


@pytest.fixture
def engine(empty_database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(sync_url(empty_database_url))
    yield engine
    engine.dispose()


async def test_open_holds_move_to_their_own_rows_and_back(
    empty_database_url: str, engine: sa.Engine
) -> None:
    url = empty_database_url
    migrate(url, "0013")
    with engine.begin() as conn:
        for n, state in _STATES.items():
            conn.execute(
                _HOLDS.insert().values(
                    reservation_id=f"{n}-a1-r", request_id=n, attempt_id=f"{n}-a1",
                    workspace="acme", key_id="k_1", endpoint="east", model="m",
                    accounts="[]", state=state, owner=f"gw/inc_{n}",
                    amount_usd=Decimal("0.5"), created_at=datetime(2026, 11, 30, tzinfo=UTC),
                )
            )  # fmt: skip
    migrate(url)
    with engine.connect() as conn:
        rows = conn.execute(holds().order_by(budget_holds.c.reservation_id)).all()
        columns = {c["name"] for c in sa.inspect(conn).get_columns("budget_holds")}
    assert [(r.reservation_id, r.state, r.owner) for r in rows] == [
        ("r1-a1-r", "held", "gw/inc_r1"),
        ("r2-a1-r", "unknown", "gw/inc_r2"),
        ("r3-a1-r", "resolved", None),  # a resolved hold keeps no owner
    ]
    assert not columns & {"state", "owner"}

    command.downgrade(_alembic_config(url), "0013")
    with engine.connect() as conn:
        back = conn.execute(
            sa.select(_HOLDS.c.reservation_id, _HOLDS.c.state, _HOLDS.c.owner).order_by(
                _HOLDS.c.reservation_id
            )
        ).all()
    assert [tuple(r) for r in back] == [
        ("r1-a1-r", "held", "gw/inc_r1"),
        ("r2-a1-r", "unknown", "gw/inc_r2"),
        ("r3-a1-r", "resolved", "unknown"),  # ledger.books.accounting.UNKNOWN_OWNER
    ]
