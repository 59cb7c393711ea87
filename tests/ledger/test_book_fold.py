"""The books are the budget events folded: what the append path keeps, the events re-derive."""

from __future__ import annotations

import contextlib
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from ledger import events as ev
from ledger.books.accounting import (
    Books,
    BudgetDenied,
    HoldStateError,
    HoldUnknown,
    Release,
    Reserve,
    Settle,
    SettleUnknown,
    effect_of,
    fold_books,
    overrun_event,
)

D = Decimal
ONE = D(1)
REFS = (
    ev.AccountRef(
        account_id="key:k1:2026-12-01", kind="key", window_start="2026-12-01", limit_usd=D(1)
    ),
    ev.AccountRef(
        account_id="workspace:acme:2026-12-01",
        kind="workspace",
        window_start="2026-12-01",
        limit_usd=D("1.5"),
    ),
)


def reserved(n: int, amount: Decimal, limit: Decimal = ONE) -> ev.BudgetReserved:
    key = REFS[0].model_copy(update={"limit_usd": limit})
    return ev.BudgetReserved(
        request_id="req_1",
        attempt_id=f"att_{n}",
        reservation_id=f"res_{n}",
        amount_usd=amount,
        accounts=(key, REFS[1]),
        endpoint="east",
        model="m",
        workspace="acme",
        key_id="k1",
        owner="gw-a/1",
    )


def settled(n: int, held: Decimal, cost: Decimal) -> list[ev.Event]:
    event = ev.BudgetSettled(
        request_id="req_1",
        attempt_id=f"att_{n}",
        reservation_id=f"res_{n}",
        reserved_usd=held,
        settled_usd=cost,
        released_usd=max(D(0), held - cost),
        usage=ev.Usage(input_tokens=1, output_tokens=1),
    )
    overrun = overrun_event(
        request_id="req_1",
        attempt_id=f"att_{n}",
        reservation_id=f"res_{n}",
        accounts=[r.account_id for r in REFS],
        held=held,
        actual=cost,
        cause="usage_above_reservation",
    )
    return [event] if overrun is None else [event, overrun]


def test_each_budget_event_means_one_effect() -> None:
    reserve = effect_of(reserved(1, D("0.2")))
    assert isinstance(reserve, Reserve)
    assert reserve.hold.owner == "gw-a/1" and reserve.hold.amount_usd == D("0.2")
    assert [s.key_id for s in reserve.specs] == ["k1", None]
    assert effect_of(settled(1, D("0.2"), D("0.3"))[0]) == Settle("res_1", D("0.3"))
    common = {"request_id": "req_1", "attempt_id": "att_1", "reservation_id": "res_1"}
    assert effect_of(ev.BudgetReleased(**common, released_usd=D(1), reason="x")) == Release("res_1")
    opened = ev.UnknownUsageOpened(
        **common,
        settlement_id="unk_1",
        workspace="acme",
        key_id="k1",
        endpoint="east",
        model="m",
        held_usd=D(1),
        cause="timeout",
    )
    assert effect_of(opened) == HoldUnknown("res_1")
    settled_unknown = ev.UnknownUsageSettled(
        **common,
        settlement_id="unk_1",
        held_usd=D(1),
        settled_usd=D(2),
        released_usd=D(0),
        source="operator",
        actor="k_admin",
    )
    assert effect_of(settled_unknown) == SettleUnknown("res_1", D(2))
    assert effect_of(settled(1, D(1), D(2))[1]) is None  # the overrun follows the settlement


step = st.tuples(
    st.sampled_from(["reserve", "settle", "release", "unknown", "settle_unknown", "raise"]),
    st.integers(0, 12),
    st.decimals(min_value=0, max_value=2, places=3),
)


def _events(books: Books, action: str, n: int, amount: Decimal, limit: Decimal) -> list[ev.Event]:
    hold = books.holds.get(f"res_{n}")
    held = hold.amount_usd if hold else D(0)
    common = {"request_id": "req_1", "attempt_id": f"att_{n}", "reservation_id": f"res_{n}"}
    match action:
        case "reserve":
            return [reserved(n, amount, limit)]
        case "settle":
            return settled(n, held, amount)
        case "release":
            return [ev.BudgetReleased(**common, released_usd=held, reason="not_started")]
        case "unknown":
            return [
                ev.UnknownUsageOpened(
                    **common,
                    settlement_id=f"unk_{n}",
                    workspace="acme",
                    key_id="k1",
                    endpoint="east",
                    model="m",
                    held_usd=held,
                    cause="timeout",
                )
            ]
    event = ev.UnknownUsageSettled(
        **common,
        settlement_id=f"unk_{n}",
        held_usd=held,
        settled_usd=amount,
        released_usd=max(D(0), held - amount),
        source="operator",
        actor="k_admin",
    )
    overrun = overrun_event(
        **common,
        accounts=[r.account_id for r in REFS],
        held=held,
        actual=amount,
        cause="operator_settlement",
    )
    return [event] if overrun is None else [event, overrun]


def _state(books: Books) -> tuple[object, ...]:
    return (
        {
            k: (a.kind, a.key_id, a.limit_usd, a.held_usd, a.settled_usd, a.overrun_usd)
            for k, a in books.accounts.items()
        },
        {k: (h.amount_usd, h.state, h.accounts, h.owner) for k, h in books.holds.items()},
        sorted(books.resolutions, key=lambda r: r.reservation_id),
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=60))
def test_folding_the_recorded_events_gives_the_books_the_append_path_kept(script) -> None:
    # The append path: each step's events with their effects, all or nothing, limits
    # judged (a limit raised in the config shows in the next reservation's events).
    live = Books()
    recorded: list[tuple[int, ev.Event]] = []
    limit = D(1)
    for action, n, amount in script:
        if action == "raise":
            limit += amount
            continue
        events = _events(live, action, n, amount, limit)
        effects = [e for e in map(effect_of, events) if e is not None]
        with contextlib.suppress(BudgetDenied, HoldStateError):
            live.apply(effects)
            recorded.extend((len(recorded) + 1, e) for e in events)
    folded, problems = fold_books(recorded)
    assert problems == []
    assert _state(folded) == _state(live)


def test_a_settlement_without_its_overrun_event_is_a_problem_of_the_fold() -> None:
    events = [reserved(1, D("0.1")), settled(1, D("0.1"), D("0.4"))[0]]
    _, problems = fold_books(enumerate(events, 1))
    assert [(p.position, p.event_type) for p in problems] == [(2, "BudgetOverrun")]
    doubled = [reserved(1, D("0.1")), *settled(1, D("0.1"), D("0.4"))]
    doubled.append(doubled[-1])  # the overrun recorded twice
    _, problems = fold_books(enumerate(doubled, 1))
    assert [p.position for p in problems] == [4]


def test_an_event_that_resolves_no_hold_is_a_problem_of_the_fold_not_a_crash() -> None:
    _, problems = fold_books([(7, settled(3, D(1), D(1))[0])])
    assert len(problems) == 1 and problems[0].position == 7 and "res_3" in problems[0].detail
