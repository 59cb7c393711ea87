"""Matching a provider's buckets against the ledger: the pure core, by example and by property."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.books.accounting import Rates
from ledger.events import Usage
from ledger.finance.buckets import (
    QUANTUM,
    EndpointIdentity,
    LedgerAttempt,
    apportion,
    model_key,
    reconcile_buckets,
)
from ledger.finance.provider_reports import Bucket, ParsedReport, ReportFormat, ReportRow
from ledger.finance.provider_reports._fields import Where

D = Decimal
T0 = datetime(2026, 11, 30, 14, tzinfo=UTC)
HOUR = timedelta(hours=1)
EAST = EndpointIdentity("east", "openai", project_id="proj_east")
WEST = EndpointIdentity("west", "openai", project_id="proj_west", api_key_id="key_west")
# $1 / $2 per million input / output tokens: 1000 in + 500 out = $0.002.
RATES = {
    (e, "gpt-4o-mini"): Rates(D(1), D(1), D(2), D(1), D(2)) for e in ("east", "west", "shared")
}


def row(
    hour: int = 0,
    *,
    project: str | None = "proj_east",
    key: str | None = None,
    model: str | None = "gpt-4o-mini-2024-07-18",
    tokens: tuple[int, int] = (1000, 500),
    cost: str | None = None,
    requests: int = 1,
) -> ReportRow:
    start = T0 + hour * HOUR
    return ReportRow(
        where="test",
        start=start,
        end=start + HOUR,
        model=model,
        project_id=project,
        api_key_id=key,
        usage=None if cost is not None else Usage(input_tokens=tokens[0], output_tokens=tokens[1]),
        requests=None if cost is not None else requests,
        cost_usd=None if cost is None else D(cost),
    )


def report(
    rows: list[ReportRow], hours: int = 2, report_format: ReportFormat = "openai-usage"
) -> ParsedReport:
    buckets = tuple(
        Bucket(
            T0 + h * HOUR,
            T0 + (h + 1) * HOUR,
            tuple(r for r in rows if r.start == T0 + h * HOUR),
            Where(None, 1, ""),
        )
        for h in range(hours)
    )
    return ParsedReport(report_format, buckets, tuple(r for b in buckets for r in b.rows))


def attempt(
    n: int,
    state: str = "settled",
    *,
    endpoint: str = "east",
    minute: int = 5,
    settled: str = "0.002",
    held: str = "0.01",
    model: str = "gpt-4o-mini",
) -> LedgerAttempt:
    known = state == "settled"
    return LedgerAttempt(
        reservation_id=f"res_{n}",
        attempt_id=f"att_{n}",
        endpoint=endpoint,
        model=model,
        state=state,
        started_at=T0 + timedelta(minutes=minute),
        reserved_usd=D(held),
        settled_usd=D(settled) if state in ("settled", "unknown_settled") else D(0),
        held_unknown_usd=D(held) if state == "unknown" else D(0),
        usage=Usage(input_tokens=1000, output_tokens=500) if known else None,
        settlement_id=f"unk_{n}" if state == "unknown" else None,
    )


def test_model_snapshots_compare_as_their_model() -> None:
    assert model_key("gpt-4o-mini-2024-07-18") == "gpt-4o-mini"
    assert model_key("claude-3-5-haiku-20241022") == "claude-3-5-haiku"
    assert model_key("claude-sonnet-4-5") == "claude-sonnet-4-5"


def test_a_bucket_the_ledger_explains_matches() -> None:
    plan = reconcile_buckets(report([row()]), [EAST], [attempt(1)], RATES)
    (comparison,) = plan.comparisons
    assert comparison.status == "matched" and comparison.within_tolerance
    assert (comparison.bucket, comparison.bucket_end) == ("2026-11-30T14:00Z", "2026-11-30T15:00Z")
    assert comparison.model == "gpt-4o-mini" and comparison.endpoints == ("east",)
    assert comparison.provider_usd == comparison.ledger_usd == D("0.002")
    assert comparison.difference_input_tokens == 0 and comparison.provider_requests == 1
    assert not plan.settlements and not plan.unattributed


def test_the_excess_settles_unknown_holds_in_proportion_to_them() -> None:
    # Provider: 3 calls' worth ($0.006); the ledger knows one ($0.002); holds 0.01 and 0.03.
    rows = [row(tokens=(3000, 1500), requests=3)]
    attempts = [attempt(1), attempt(2, "unknown", held="0.01"), attempt(3, "unknown", held="0.03")]
    plan = reconcile_buckets(report(rows), [EAST], attempts, RATES)
    assert [(s.attempt.attempt_id, s.amount) for s in plan.settlements] == [
        ("att_2", D("0.001")),
        ("att_3", D("0.003")),
    ]
    assert all(s.bucket == "2026-11-30T14:00Z" for s in plan.settlements)
    assert plan.settlements[0].reason.startswith(
        "settled from OpenAI usage bucket 2026-11-30T14:00Z (model gpt-4o-mini, endpoint east)"
    )
    (comparison,) = plan.comparisons
    assert comparison.status == "settled_unknown" and comparison.unknown_settlements == 2
    assert comparison.settled_unknown_usd == D("0.004") and comparison.held_unknown_usd == D("0.04")
    assert comparison.difference_usd == 0 and comparison.within_tolerance
    assert not plan.unattributed


def test_unknown_holds_are_released_where_the_provider_shows_nothing_more() -> None:
    attempts = [attempt(1), attempt(2, "unknown")]
    plan = reconcile_buckets(report([row()]), [EAST], attempts, RATES)
    assert [(s.attempt.attempt_id, s.amount) for s in plan.settlements] == [("att_2", D(0))]
    assert plan.settlements[0].reason.startswith("released: OpenAI usage bucket 2026-11-30T14:00Z")
    assert plan.comparisons[0].status == "released_unknown"
    # An empty bucket is the provider saying nothing was billed at all.
    plan = reconcile_buckets(report([row(0)]), [EAST], [attempt(3, "unknown", minute=70)], RATES)
    (released,) = plan.settlements
    assert released.amount == 0 and released.bucket == "2026-11-30T15:00Z"


def test_usage_no_attempt_explains_is_unattributed() -> None:
    rows = [row(tokens=(5000, 2500), requests=5)]
    plan = reconcile_buckets(report(rows), [EAST], [attempt(1)], RATES)
    (comparison,) = plan.comparisons
    assert comparison.status == "unattributed" and not comparison.within_tolerance
    (extra,) = plan.unattributed
    assert (extra.input_tokens, extra.output_tokens, extra.requests) == (4000, 2000, 4)
    assert extra.usd == D("0.008") and extra.endpoints == ("east",)
    assert extra.project_id == "proj_east" and extra.bucket == "2026-11-30T14:00Z"
    # A model the ledger never sent on that identity: all of it.
    plan = reconcile_buckets(report([row(model="gpt-4o-2024-08-06")]), [EAST], [], RATES)
    (extra,) = plan.unattributed
    assert extra.model == "gpt-4o" and extra.usd is None and extra.input_tokens == 1000


def test_attempts_in_flight_hold_back_their_bucket() -> None:
    attempts = [attempt(1, "held"), attempt(2, "unknown")]
    plan = reconcile_buckets(report([row(tokens=(3000, 1500))]), [EAST], attempts, RATES)
    assert plan.comparisons[0].status == "in_progress" and not plan.settlements


def test_a_ledger_above_the_provider_is_reported_not_settled() -> None:
    plan = reconcile_buckets(report([]), [EAST], [attempt(1)], RATES)
    (comparison,) = plan.comparisons
    assert comparison.status == "ledger_above_provider" and comparison.provider_usd == 0
    assert comparison.difference_usd == D("-0.002")


def test_results_of_other_identities_are_not_ours() -> None:
    rows = [row(project="proj_other"), row(project="proj_west", key="key_west")]
    plan = reconcile_buckets(report(rows), [EAST, WEST], [], RATES)
    assert [c.endpoints for c in plan.comparisons] == [("west",)]
    assert plan.notes == ["1 result(s) of the report belong to no endpoint in scope: not compared"]


def test_an_endpoint_the_report_does_not_group_by_is_not_compared() -> None:
    anthropic = EndpointIdentity("claude", "anthropic", workspace_id="wrkspc_1")
    keyed = EndpointIdentity("keyed", "openai", api_key_id="key_1")
    rows = [row(key=None)]  # grouped by project only
    plan = reconcile_buckets(
        report(rows), [EAST, keyed, anthropic], [attempt(9, endpoint="keyed")], RATES
    )
    assert [c.endpoints for c in plan.comparisons] == [("east",)]
    assert plan.notes == ["endpoint keyed: the report is not grouped by api_key_id: not compared"]


def test_endpoints_sharing_results_are_compared_together() -> None:
    one = EndpointIdentity("east", "openai", project_id="proj_shared")
    two = EndpointIdentity("shared", "openai", project_id="proj_shared")
    rows = [row(project="proj_shared", tokens=(2000, 1000), requests=2)]
    attempts = [attempt(1), attempt(2, endpoint="shared")]
    plan = reconcile_buckets(report(rows), [one, two], attempts, RATES)
    (comparison,) = plan.comparisons
    assert comparison.endpoints == ("east", "shared") and comparison.status == "matched"
    assert comparison.ledger_attempts == 2 and comparison.project_id == "proj_shared"


def test_a_cost_report_compares_every_model_of_an_identity_together() -> None:
    daily = [row(model=None, cost="0.004", project="proj_east")]
    attempts = [attempt(1), attempt(2, model="gpt-4o", settled="0.002")]
    plan = reconcile_buckets(report(daily, 1, "openai-costs"), [EAST], attempts, RATES)
    (comparison,) = plan.comparisons
    assert comparison.model is None and comparison.status == "matched"
    assert comparison.provider_usage is None and comparison.provider_requests is None


# --- properties ---


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 10**9),
    st.lists(st.integers(0, 10**6), min_size=1, max_size=8),
)
def test_apportion_adds_up_exactly_and_follows_the_weights(units: int, weights: list[int]) -> None:
    total = units * QUANTUM
    held = [D(w) * D("0.000001") for w in weights]
    shares = apportion(total, held)
    assert sum(shares) == total and all(s >= 0 for s in shares)
    whole = sum(held)
    for share, weight in zip(shares, held, strict=True):
        exact = total * weight / whole if whole else total / len(held)
        assert abs(share - exact) < QUANTUM
    for i, j in zip(range(len(held)), range(1, len(held)), strict=False):
        if held[i] > held[j]:
            assert shares[i] >= shares[j]


attempt_states = st.sampled_from(["settled", "unknown", "unknown_settled", "released", "held"])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # hour (2 is outside the report)
            st.sampled_from(["proj_east", "proj_west", "proj_other"]),
            st.integers(0, 5000),
            st.integers(0, 5000),
        ),
        max_size=6,
    ),
    st.lists(
        st.tuples(
            attempt_states,
            st.sampled_from(["east", "west"]),
            st.integers(0, 179),  # minute: the third hour is outside the report
            st.integers(1, 5000),
        ),
        max_size=10,
    ),
)
def test_every_attempt_in_a_bucket_is_compared_once_and_excess_is_settled_exactly(
    results: list[tuple[int, str, int, int]], ledger: list[tuple[str, str, int, int]]
) -> None:
    west = EndpointIdentity("west", "openai", project_id="proj_west")
    rows = [
        row(h, project=p, tokens=(i, o), key=None)
        for h, p, i, o in {(h, p): (h, p, i, o) for h, p, i, o in results if h < 2}.values()
    ]
    attempts = [
        attempt(n, state, endpoint=endpoint, minute=minute, held=str(D(held) / 10**6))
        for n, (state, endpoint, minute, held) in enumerate(ledger)
    ]
    plan = reconcile_buckets(report(rows), [EAST, west], attempts, RATES)
    in_report = [a for a in attempts if a.started_at < T0 + 2 * HOUR and a.state != "released"]
    assert sum(c.ledger_attempts for c in plan.comparisons) == len(in_report)
    keys = Counter((c.bucket, c.model, c.endpoints) for c in plan.comparisons)
    assert all(n == 1 for n in keys.values())
    settled = [s.attempt.attempt_id for s in plan.settlements]
    assert len(settled) == len(set(settled))
    assert all(s.attempt.state == "unknown" and s.attempt.settlement_id for s in plan.settlements)
    for comparison in plan.comparisons:
        assert comparison.provider_usd is not None
        excess = comparison.provider_usd - comparison.ledger_usd
        if comparison.status == "settled_unknown":
            assert comparison.settled_unknown_usd == excess > 0
            assert comparison.difference_usd == 0
        elif comparison.status == "released_unknown":
            assert excess <= 0 and comparison.settled_unknown_usd == 0
        if comparison.status in ("settled_unknown", "released_unknown", "in_progress"):
            assert comparison.held_unknown_usd > 0 or comparison.status == "in_progress"
    settled_total = sum((s.amount for s in plan.settlements), D(0))
    assert settled_total == sum((c.settled_unknown_usd for c in plan.comparisons), D(0))
    unattributed = {(u.bucket, u.model, u.endpoints) for u in plan.unattributed}
    for comparison in plan.comparisons:
        if (comparison.bucket, comparison.model, comparison.endpoints) in unattributed:
            assert comparison.status == "unattributed" and comparison.held_unknown_usd == 0
    ours = [r for r in rows if r.project_id in ("proj_east", "proj_west")]
    provider_total = sum((c.provider_usd or D(0) for c in plan.comparisons), D(0))
    assert provider_total == sum(
        (
            D(r.usage.input_tokens) / 10**6 + D(r.usage.output_tokens) * 2 / 10**6
            for r in ours
            if r.usage
        ),
        D(0),
    )


class _PriceRaisedAtT1:
    """$1 / $2 per million until the second bucket, then double: a price book with history."""

    def __call__(self, endpoint: str, model: str, at: datetime) -> Rates | None:
        return RATES[(endpoint, model)] if at < T0 + HOUR else Rates(D(2), D(2), D(4), D(2), D(4))

    def fingerprint(self) -> str:
        return "raised-at-T1"


def test_each_bucket_is_priced_with_the_price_in_force_at_its_start() -> None:
    plan = reconcile_buckets(
        report([row(0), row(1)]),
        [EAST],
        [attempt(1), attempt(2, minute=65, settled="0.004")],
        _PriceRaisedAtT1(),
    )
    first, second = plan.comparisons
    assert (first.provider_usd, second.provider_usd) == (D("0.002"), D("0.004"))
    assert first.status == second.status == "matched"
