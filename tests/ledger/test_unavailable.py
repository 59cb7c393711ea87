"""One classification of database failures: "not now" (503 ledger_unavailable, retryable)
or a bug (500), whichever driver raised it."""

from __future__ import annotations

import asyncpg
import pytest
from sqlalchemy import exc as sa_exc

from ledger.store.db import is_unavailable


class _Sqlstate(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"sqlstate {sqlstate}")
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    ("sqlstate", "unavailable"),
    [
        ("55000", True),  # a database not accepting connections (ALLOW_CONNECTIONS false)
        ("57P01", True),  # admin shutdown
        ("53300", True),  # too many connections
        ("08006", True),  # connection failure
        ("40001", True),  # serialization failure: a retry may succeed
        ("3D000", True),  # no such database
        ("28P01", True),  # password authentication failed
        ("23505", False),  # a unique key broken: a bug, a retry would break it again
        ("23514", False),  # a CHECK broken: the books' invariant, never "not now"
        ("42P01", False),  # no such table: a schema the code does not expect
    ],
)
def test_postgres_errors_are_judged_by_their_sqlstate_class(
    sqlstate: str, unavailable: bool
) -> None:
    assert is_unavailable(_Sqlstate(sqlstate)) is unavailable
    wrapped = sa_exc.DBAPIError("SELECT 1", {}, _Sqlstate(sqlstate))
    assert is_unavailable(wrapped) is unavailable


@pytest.mark.parametrize(
    ("message", "unavailable"),
    [
        ("not connected", True),
        ('cannot switch to state 12; protocol is in the "failed" state', True),
        ("cannot switch to state 12; another operation (2) is in progress", True),
        ("cannot switch to state 12; another operation (11) is in progress", False),
    ],
)
def test_asyncpg_after_a_broken_connection_is_unavailable_but_misuse_is_a_bug(
    message: str, unavailable: bool
) -> None:
    assert is_unavailable(asyncpg.InternalClientError(message)) is unavailable


def test_connection_trouble_is_unavailable() -> None:
    assert is_unavailable(ConnectionRefusedError())
    assert is_unavailable(TimeoutError())
    assert not is_unavailable(ValueError("a bug"))
