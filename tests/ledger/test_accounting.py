"""The accounting rules, pure: reserve, settle, release, unknown — and the invariant."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.books.accounting import (
    AccountSpec,
    Books,
    BudgetDenied,
    Effect,
    Hold,
    HoldStateError,
    HoldUnknown,
    Rates,
    Release,
    Reserve,
    Resolution,
    Settle,
    SettleUnknown,
    account_specs,
    settlement_refusal,
    usage_cost,
    window_start,
)
from ledger.events import Usage

D = Decimal
LIMIT = D("1.00")
SPEC = AccountSpec("key:k1:2026-11-30", "key", "acme", "k1", "2026-11-30", LIMIT)


def hold(n: int, amount: str, specs: tuple[AccountSpec, ...] = (SPEC,)) -> Reserve:
    return Reserve(
        Hold(f"res_{n}", "req_1", f"att_{n}", "acme", "k1", "east", "m", D(amount), (), "i1"),
        specs,
    )


def _rates(
    input_: str = "0",
    output: str = "0",
    cached: str = "0",
    audio_input: str = "0",
    audio_output: str = "0",
    web_search: str | None = None,
) -> Rates:
    return Rates(
        input_per_mtok=D(input_),
        cached_input_per_mtok=D(cached),
        output_per_mtok=D(output),
        audio_input_per_mtok=D(audio_input),
        audio_output_per_mtok=D(audio_output),
        web_search_usd=None if web_search is None else D(web_search),
    )


def test_usage_cost_prices_cached_input_and_rounds_up() -> None:
    usage = Usage(input_tokens=1000, output_tokens=500, cached_input_tokens=400)
    cost = usage_cost(usage, _rates("0.15", "0.60", "0.075"))
    assert cost == D("0.00009") + D("0.00003") + D("0.0003")
    tiny = usage_cost(Usage(input_tokens=1, output_tokens=0), _rates("0.0000001"))
    assert tiny == D("0.000000000001")  # 1e-13 rounds up to the quantum, never down to 0


def test_usage_cost_prices_audio_tokens_at_their_own_rates_inside_the_counts() -> None:
    usage = Usage(
        input_tokens=1000, output_tokens=300, audio_input_tokens=400, audio_output_tokens=200
    )
    cost = usage_cost(usage, _rates("1", "2", "1", audio_input="40", audio_output="80"))
    text = 600 * 1 + 100 * 2
    audio = 400 * 40 + 200 * 80
    assert cost == D(text + audio) / 10**6


def test_cached_tokens_that_may_be_audio_are_priced_as_audio() -> None:
    # 300 cached of 1000 input, 400 of them audio: the provider does not say which are
    # cached, so the cache discounts no text token; with 500 cached, 100 text tokens.
    rates = _rates("2", cached="1", audio_input="40")
    audio = 400 * 40
    for cached, cached_text in ((300, 0), (500, 100), (1000, 600)):
        usage = Usage(
            input_tokens=1000, output_tokens=0, cached_input_tokens=cached, audio_input_tokens=400
        )
        expected = audio + (600 - cached_text) * 2 + cached_text * 1
        assert usage_cost(usage, rates) == D(expected) / 10**6


def test_web_searches_cost_their_fee_each_and_are_never_free() -> None:
    usage = Usage(input_tokens=0, output_tokens=0, web_searches=3)
    assert usage_cost(usage, _rates(web_search="0.025")) == D("0.075")
    with pytest.raises(ValueError, match="no price"):
        usage_cost(usage, _rates())


def test_usage_cost_is_exact_beyond_the_default_precision() -> None:
    tokens = 10**18 + 1
    cost = usage_cost(Usage(input_tokens=tokens, output_tokens=0), _rates("1234567.123456"))
    assert Fraction(cost) == tokens * Fraction("1234567.123456") / 10**6  # 31 digits


def test_windows_roll_over_at_utc_boundaries() -> None:
    last = datetime(2026, 11, 30, 23, 59, 59, tzinfo=UTC)
    first = datetime(2026, 12, 1, 0, 0, 0, tzinfo=UTC)
    assert window_start("day", last) == "2026-11-30"
    assert window_start("day", first) == "2026-12-01"
    assert window_start("month", last) == "2026-11-01"
    assert window_start("month", first) == "2026-12-01"
    assert window_start("total", first) is None
    specs = account_specs(
        request_id="r",
        workspace="acme",
        key_id="k",
        now=first,
        request_limit=D("0.5"),
        key_budget=(D(10), "day"),
        workspace_budget=(D(100), "month"),
    )
    assert [s.account_id for s in specs] == [
        "request:r",
        "key:k:2026-12-01",
        "workspace:acme:2026-12-01",
    ]


def test_reserve_then_settle_posts_the_cost_and_releases_the_rest() -> None:
    books = Books()
    books.apply([hold(1, "0.40")])
    assert books.accounts[SPEC.account_id].held_usd == D("0.40")
    books.apply([Settle("res_1", D("0.10"))])
    account = books.accounts[SPEC.account_id]
    assert (account.held_usd, account.settled_usd) == (D(0), D("0.10"))
    assert books.resolutions[-1].released_usd == D("0.30")


def test_a_reservation_over_the_limit_is_denied_and_changes_nothing() -> None:
    other = AccountSpec("workspace:acme:2026-11", "workspace", "acme", None, "2026-11-01", D("0.5"))
    books = Books()
    books.apply([hold(1, "0.40", (SPEC, other))])
    with pytest.raises(BudgetDenied) as denied:
        books.apply([hold(2, "0.20", (SPEC, other))])
    assert denied.value.account_id == other.account_id
    assert denied.value.available_usd == D("0.10")
    assert books.accounts[SPEC.account_id].held_usd == D("0.40")  # the key was not touched
    assert "res_2" not in books.holds


def test_unknown_usage_stays_counted_until_settled() -> None:
    books = Books()
    books.apply([hold(1, "0.60"), HoldUnknown("res_1")])
    with pytest.raises(BudgetDenied):
        books.apply([hold(2, "0.50")])  # a failover after an unknown attempt must fit
    books.apply([hold(3, "0.40")])
    books.apply([SettleUnknown("res_1", D("0.05"))])
    account = books.accounts[SPEC.account_id]
    assert (account.held_usd, account.settled_usd) == (D("0.40"), D("0.05"))


def test_a_hold_is_resolved_exactly_once() -> None:
    books = Books()
    books.apply([hold(1, "0.10"), Release("res_1")])
    for effect in (Release("res_1"), Settle("res_1", D(0)), HoldUnknown("res_1")):
        with pytest.raises(HoldStateError):
            books.apply([effect])
    with pytest.raises(HoldStateError):
        books.apply([hold(1, "0.10")])  # the same reservation id again
    with pytest.raises(HoldStateError):
        books.apply([SettleUnknown("res_1", D(0))])


def test_usage_above_the_hold_is_settled_in_full_and_the_excess_is_an_overrun() -> None:
    books = Books()
    books.apply([hold(1, "0.30"), Settle("res_1", D("0.90"))])
    account = books.accounts[SPEC.account_id]
    assert (account.held_usd, account.settled_usd, account.overrun_usd) == (
        D(0),
        D("0.90"),
        D("0.60"),
    )
    assert books.resolutions == [Resolution("res_1", "settled", D("0.90"), D(0), D("0.60"))]


def test_an_unknown_settlement_above_the_hold_is_an_overrun_too() -> None:
    books = Books()
    books.apply([hold(1, "0.30"), HoldUnknown("res_1"), SettleUnknown("res_1", D("0.50"))])
    account = books.accounts[SPEC.account_id]
    assert (account.settled_usd, account.overrun_usd) == (D("0.50"), D("0.20"))
    assert books.resolutions[0].kind == "unknown_settled"


def test_an_account_in_overrun_admits_nothing_until_its_limit_is_raised() -> None:
    books = Books()
    books.apply([hold(1, "0.90"), Settle("res_1", D("1.50"))])  # 1.50 spent of a 1.00 limit
    assert books.accounts[SPEC.account_id].available_usd == 0
    with pytest.raises(BudgetDenied) as denied:
        books.apply([hold(2, "0.000001")])
    assert denied.value.available_usd == 0
    raised = replace(SPEC, limit_usd=D("2.00"))
    books.apply([hold(3, "0.50", (raised,))])  # 1.50 + 0.50 fits the raised limit
    with pytest.raises(BudgetDenied):
        books.apply([hold(4, "0.000001", (raised,))])


def test_settlement_refusal_takes_only_absurd_amounts_for_mistakes() -> None:
    assert settlement_refusal(D("0.001"), D("0.5")) is None  # 500x: an overrun, not absurd
    assert settlement_refusal(D("0.001"), D("1.000")) is None  # exactly 1,000x
    refusal = settlement_refusal(D("0.001"), D("1.001"))
    assert refusal is not None and "1000x" in refusal
    assert settlement_refusal(D("0.001"), D("1.001"), force=True) is None
    assert settlement_refusal(D(0), D("0.000001")) is not None  # nothing was held
    assert settlement_refusal(D(1), D(10) ** 16, force=True) is not None  # no bill is that
    assert settlement_refusal(D(1), D(-1), force=True) is not None
    assert settlement_refusal(D(1), D("NaN"), force=True) is not None


step = st.tuples(
    st.sampled_from(["reserve", "settle", "release", "unknown", "settle_unknown"]),
    st.integers(0, 15),
    st.decimals(min_value=0, max_value=1, places=3),
)
steps = st.lists(step, max_size=60)


def _effect(action: str, n: int, amount: Decimal) -> Effect:
    if action == "reserve":
        return hold(n, str(amount))
    if action == "settle":
        return Settle(f"res_{n}", amount)
    if action == "release":
        return Release(f"res_{n}")
    if action == "unknown":
        return HoldUnknown(f"res_{n}")
    return SettleUnknown(f"res_{n}", amount)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_settled_plus_held_never_exceeds_the_limit(script) -> None:
    books = Books()
    for action, n, amount in script:
        effect = _effect(action, n, amount)
        with contextlib.suppress(BudgetDenied, HoldStateError):
            books.apply([effect])
        for account in books.accounts.values():
            assert account.held_usd >= 0 and 0 <= account.overrun_usd <= account.settled_usd
            # Reservations never exceed the limit; beyond it is exactly the overruns.
            assert account.held_usd + account.settled_usd - account.overrun_usd <= (
                account.limit_usd
            )
        held = sum((h.amount_usd for h in books.holds.values() if h.state != "resolved"), D(0))
        if books.accounts:
            account = books.accounts[SPEC.account_id]
            assert account.held_usd == held
            assert account.settled_usd == sum((r.settled_usd for r in books.resolutions), D(0))
            assert account.overrun_usd == sum((r.overrun_usd for r in books.resolutions), D(0))


def _state(books: Books) -> tuple[object, ...]:
    return (
        {
            k: (a.limit_usd, a.held_usd, a.settled_usd, a.overrun_usd)
            for k, a in books.accounts.items()
        },
        {k: (h.amount_usd, h.state, h.accounts) for k, h in books.holds.items()},
        set(books.new_accounts),
        set(books.changed_accounts),
        set(books.new_holds),
        set(books.changed_holds),
        list(books.resolutions),
    )


OTHER = AccountSpec("workspace:acme:2026-11", "workspace", "acme", None, "2026-11-01", D("0.7"))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(step, max_size=4), max_size=30))
def test_an_apply_is_all_or_nothing(script) -> None:
    # Several effects per apply (as one append carries them): one refusal among them leaves
    # every balance, hold, change set and resolution exactly as before the apply.
    books = Books()
    for group in script:
        effects = [
            hold(n, str(amount), (SPEC, OTHER))
            if action == "reserve"
            else _effect(action, n, amount)
            for action, n, amount in group
        ]
        before = _state(books)
        try:
            books.apply(effects)
        except (BudgetDenied, HoldStateError):
            assert _state(books) == before


def test_applying_effects_leaves_them_as_they_were_so_they_can_be_applied_again() -> None:
    # The store decides a batch a second time (a lost race, a wrong guess) with the same
    # effects: a reservation settled in the first try must not come back resolved.
    effects: list[Effect] = [hold(1, "0.40"), Settle("res_1", D("0.10"))]
    for _ in range(2):
        books = Books()
        books.apply(effects)
        assert books.holds["res_1"].state == "resolved"
        assert (books.accounts[SPEC.account_id].settled_usd, books.resolutions[0].kind) == (
            D("0.10"),
            "settled",
        )
    reserve = effects[0]
    assert isinstance(reserve, Reserve)
    assert (reserve.hold.state, reserve.hold.accounts) == ("held", ())


def test_cache_writes_are_priced_at_their_lifetimes_rate_inside_the_input() -> None:
    # 1000 input tokens: 100 read from the cache, 200 written for 5 minutes, 50 for an hour.
    usage = Usage(
        input_tokens=1000,
        output_tokens=10,
        cached_input_tokens=100,
        cache_write_input_tokens=200,
        cache_write_1h_input_tokens=50,
    )
    rates = replace(
        _rates("3", "15", "0.3"), cache_write_per_mtok=D("3.75"), cache_write_1h_per_mtok=D("6")
    )
    expected = D("650") * 3 + D("100") * D("0.3") + 200 * D("3.75") + 50 * 6 + 10 * 15
    assert usage_cost(usage, rates) == expected / 10**6
    # Without a price for them, writes are settled as the next price the rates have: an
    # hour's at the 5-minute rate, a 5-minute one at the input rate (as before the split).
    no_hour = replace(rates, cache_write_1h_per_mtok=None)
    assert usage_cost(usage, no_hour) == (expected - 50 * 6 + 50 * D("3.75")) / 10**6
    none = replace(rates, cache_write_per_mtok=None, cache_write_1h_per_mtok=None)
    assert usage_cost(usage, none) == (D(900) * 3 + 100 * D("0.3") + 10 * 15) / 10**6


def test_cache_writes_beyond_the_input_count_bill_no_token_twice() -> None:
    usage = Usage(
        input_tokens=10,
        output_tokens=0,
        cached_input_tokens=10,
        cache_write_input_tokens=8,
        cache_write_1h_input_tokens=5,
    )
    rates = replace(
        _rates("1", cached="0.1"), cache_write_per_mtok=D(2), cache_write_1h_per_mtok=D(4)
    )
    assert usage_cost(usage, rates) == D(5 * 4 + 5 * 2) / 10**6
