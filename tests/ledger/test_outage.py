"""An outage told twice (ledger.store.outage): when it begins and when it ends, with what
it cost in between."""

from __future__ import annotations

import logging

import pytest

from ledger.store.db import LedgerUnavailable
from ledger.store.outage import Outage, cause_of


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _down(outage: Outage) -> bool:
    return outage.down  # (a function: mypy would narrow the property between the asserts)


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "waybill.ledger"]


def test_an_outage_is_told_once_when_it_begins_and_once_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    clock = _Clock()
    outage = Outage(clock)
    outage.succeeded()  # no outage: nothing to say
    assert _said(caplog) == []
    for _ in range(3):
        outage.refused(ConnectionRefusedError())
    outage.failed(TimeoutError())
    outage.recorded_late()
    outage.recorded_late()
    outage.not_recorded()
    assert _down(outage)
    assert _said(caplog) == [
        "the ledger is unavailable (ConnectionRefusedError): requests are refused with 503 "
        "ledger_unavailable until it is back"
    ]
    clock.now += 12.5
    outage.succeeded()
    outage.succeeded()
    assert not _down(outage)
    assert _said(caplog)[1:] == [
        "the ledger is available again after 12.5 s: 3 requests were refused, 2 request "
        "ends were not recorded at once (retried; 1 left to crash recovery)"
    ]
    # The next outage counts afresh.
    outage.refused(OSError())
    outage.succeeded()
    assert _said(caplog)[-1].endswith(
        ": 1 requests were refused, 0 request ends were not "
        "recorded at once (retried; 0 left to crash recovery)"
    )


def test_the_cause_is_named_by_type_only_and_through_a_translation() -> None:
    try:
        try:
            raise ConnectionResetError("server at 10.0.0.1 said: password for 'bob' ...")
        except ConnectionResetError:
            raise LedgerUnavailable("the ledger database failed") from None
    except LedgerUnavailable as error:
        assert cause_of(error) == "ConnectionResetError"
    assert cause_of(LedgerUnavailable("closed")) == "LedgerUnavailable"
