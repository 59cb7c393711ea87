"""Reconciliation: reading provider usage exports, matching lines to attempts, and the
recorded import (settlements, idempotence, races, scope) on both backends."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger import events as ev
from ledger.books.accounting import AccountSpec, Hold, HoldUnknown, Reserve, Settle
from ledger.books.balances import holds
from ledger.books.settlements import settle_unknown
from ledger.finance.reconcile import (
    AttemptRecord,
    ReconcileScope,
    Settlement,
    classify,
    find_reconciliation,
    import_reconciliation,
    reconciliation_id,
    unmatched_attempts,
    within_tolerance,
)
from ledger.finance.usage_export import ExportError, ProviderLine, parse_export, sniff_format
from ledger.store import ANY_VERSION, EventStore
from ledger.store.schema import budget_accounts, budget_holds

D = Decimal
T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
HEADER = "attempt_id,provider_request_id,model,input_tokens,output_tokens,cost_usd,timestamp\n"


# --- reading exports ---


def test_a_csv_export_is_read_exactly_with_extra_columns_ignored() -> None:
    data = (
        "\ufeffattempt_id,provider_request_id,model,input_tokens,output_tokens,"
        "cached_input_tokens,cost_usd,timestamp,organization\n"
        "att_1,,gpt-4o-mini,12,30,4,0.000042,2026-11-30T12:00:00Z,org-9\n"
        "\n"
        ",req_77,gpt-4o-mini,5,0,,0.1,2026-11-30T12:00:01,org-9\n"
    ).encode()
    first, second = parse_export(data)
    assert first == ProviderLine(
        line=2,
        attempt_id="att_1",
        provider_request_id=None,
        model="gpt-4o-mini",
        usage=ev.Usage(input_tokens=12, output_tokens=30, cached_input_tokens=4),
        cost_usd=D("0.000042"),
        timestamp=T0,
    )
    assert second.line == 4 and second.attempt_id is None
    assert second.provider_request_id == "req_77" and second.usage.cached_input_tokens == 0
    assert second.cost_usd == D("0.1") and second.timestamp == T0 + timedelta(seconds=1)


def test_json_numbers_are_read_as_exact_decimals_never_floats() -> None:
    data = (
        b'{"attempt_id": "att_1", "model": "m", "input_tokens": 1, "output_tokens": 2,'
        b' "cost_usd": 0.1, "timestamp": "2026-11-30T13:00:00+01:00"}\n'
        b"\n"
        b'{"provider_request_id": "r", "model": "m", "input_tokens": "3", "output_tokens": 4,'
        b' "cached_input_tokens": 1, "cost_usd": 1e-7, "timestamp": "2026-11-30T12:00:00Z"}\n'
        b'{"attempt_id": "att_3", "model": "m", "input_tokens": 0, "output_tokens": 0,'
        b' "cost_usd": "0.000000000001", "timestamp": "2026-11-30T12:00:00Z", "extra": [1]}'
    )
    lines = parse_export(data)
    assert [line.cost_usd for line in lines] == [D("0.1"), D("1E-7"), D("0.000000000001")]
    assert str(lines[0].cost_usd) == "0.1"  # not 0.1000000000000000055511151231257827
    assert [line.line for line in lines] == [1, 3, 4]
    assert lines[0].timestamp == T0  # 13:00+01:00 is 12:00 UTC
    assert lines[1].usage == ev.Usage(input_tokens=3, output_tokens=4, cached_input_tokens=1)


def test_the_format_is_sniffed_from_the_first_character() -> None:
    assert sniff_format(b'\n  {"attempt_id": 1}') == "jsonl"
    assert sniff_format(b"\xef\xbb\xbf{") == "jsonl"
    assert sniff_format(HEADER.encode()) == "csv"


ROW = "att_1,,m,1,2,0.5,2026-11-30T12:00:00Z\n"


@pytest.mark.parametrize(
    ("data", "line", "field"),
    [
        (HEADER + ROW + "att_2,,m,1,2,abc,2026-11-30T12:00:00Z\n", 3, "cost_usd"),
        (HEADER + "att_2,,m,1,2,-0.1,2026-11-30T12:00:00Z\n", 2, "cost_usd"),
        (HEADER + "att_2,,m,1,2,NaN,2026-11-30T12:00:00Z\n", 2, "cost_usd"),
        (HEADER + "att_2,,m,-1,2,0.1,2026-11-30T12:00:00Z\n", 2, "input_tokens"),
        (HEADER + "att_2,,m,1,2.5,0.1,2026-11-30T12:00:00Z\n", 2, "output_tokens"),
        (HEADER + ",,m,1,2,0.1,2026-11-30T12:00:00Z\n", 2, "attempt_id"),
        (HEADER + "att_2,,,1,2,0.1,2026-11-30T12:00:00Z\n", 2, "model"),
        (HEADER + ROW + ROW + "att_2,,m,1,2,0.1,yesterday\n", 4, "timestamp"),
        (HEADER + "att_2,,m,1,2,0.1,2026-11-30T12:00:00Z,surplus\n", 2, None),
        ("attempt_id,model,input_tokens,output_tokens,timestamp\n" + ROW, 1, "cost_usd"),
        ("model,input_tokens,output_tokens,cost_usd,timestamp\nm,1,2,0.1,x\n", 1, "attempt_id"),
        (
            HEADER + 'att_2,,"a\nb",1,2,0.1,2026-11-30T12:00:00Z\natt_3,,m,x,2,0.1,z\n',
            4,
            "input_tokens",
        ),
        ('{"attempt_id": "a", "model": "m"}\n{"attempt_id": ', 1, "input_tokens"),
        (
            '{"attempt_id": "a", "model": "m", "input_tokens": 1, "output_tokens": 2, '
            '"cost_usd": "0.1", "timestamp": "2026-11-30T12:00:00Z"}\n{"attempt_id": ',
            2,
            None,
        ),
        (
            '{"attempt_id": "a", "model": "m", "input_tokens": 1, "output_tokens": 2, '
            '"cost_usd": "0.1", "timestamp": "2026-11-30T12:00:00Z"}\n[1, 2]\n',
            2,
            None,
        ),
        (
            '{"attempt_id": "a", "model": "m", "input_tokens": 1.0, "output_tokens": 2, '
            '"cost_usd": 0.1, "timestamp": "2026-11-30T12:00:00Z"}',
            1,
            "input_tokens",
        ),
        (
            '{"attempt_id": "a", "model": "m", "input_tokens": true, "output_tokens": 2, '
            '"cost_usd": 0.1, "timestamp": "2026-11-30T12:00:00Z"}',
            1,
            "input_tokens",
        ),
        (
            '{"attempt_id": "a", "model": "m", "input_tokens": 1, "output_tokens": 2, '
            '"cost_usd": Infinity, "timestamp": "2026-11-30T12:00:00Z"}',
            1,
            None,
        ),
        (
            '{"attempt_id": 7, "model": "m", "input_tokens": 1, "output_tokens": 2, '
            '"cost_usd": 0.1, "timestamp": "2026-11-30T12:00:00Z"}',
            1,
            "attempt_id",
        ),
    ],
)
def test_a_bad_line_is_refused_naming_its_line_and_field(
    data: str, line: int, field: str | None
) -> None:
    with pytest.raises(ExportError) as refused:
        parse_export(data.encode())
    assert refused.value.line == line
    assert refused.value.field == field
    assert str(refused.value).startswith(f"line {line}" + (f", {field}:" if field else ":"))


def test_an_empty_or_undecodable_export_is_refused() -> None:
    for data in (b"", HEADER.encode(), b"\n\n"):
        with pytest.raises(ExportError, match=r"no usage lines|empty"):
            parse_export(data)
    with pytest.raises(ExportError, match="line 3: not UTF-8"):
        parse_export(HEADER.encode() + ROW.encode() + b"att_\xff,,m,1,2,0.1,x\n")


# --- tolerance and classification (pure) ---


def test_the_tolerance_is_one_percent_of_the_provider_or_a_micro_dollar() -> None:
    assert within_tolerance(D("1.00"), D("0.99"))
    assert within_tolerance(D("1.00"), D("1.01"))
    assert not within_tolerance(D("1.00"), D("0.9899"))
    assert within_tolerance(D(0), D("0.000001"))
    assert not within_tolerance(D(0), D("0.0000011"))
    assert within_tolerance(D("0.00001"), D("0.000011"))  # the floor beats 1% of tiny sums


def attempt(n: int, state: str = "settled", settled: str = "0.0012", **kw: object) -> AttemptRecord:
    record = AttemptRecord(
        reservation_id=f"res_{n}",
        request_id=f"req_{n}",
        attempt_id=f"att_{n}",
        endpoint="east",
        model="m",
        state=state,
        reserved_usd=D("0.0050"),
        settled_usd=D(settled),
        held_unknown_usd=D("0.0050") if state == "unknown" else D(0),
        reserved_at=T0 + timedelta(seconds=n),
        upstream_request_id=f"up_{n}",
        response_id=f"chatcmpl-{n}",
        settlement_id=f"unk_{n}" if state == "unknown" else None,
    )
    return replace(record, **kw)  # type: ignore[arg-type]


def line(
    number: int, attempt_id: str | None = None, request_id: str | None = None, cost: str = "0.0012"
) -> ProviderLine:
    return ProviderLine(
        line=number,
        attempt_id=attempt_id,
        provider_request_id=request_id,
        model="m",
        usage=ev.Usage(input_tokens=10, output_tokens=5),
        cost_usd=D(cost),
        timestamp=T0 + timedelta(seconds=number),
    )


def test_lines_match_by_attempt_id_then_upstream_request_id_then_response_id() -> None:
    attempts = [attempt(1), attempt(2), attempt(3)]
    result = classify(
        [
            line(2, attempt_id="att_1", request_id="up_2"),  # the attempt id wins
            line(3, attempt_id="att_gone", request_id="up_2"),  # falls back to the request id
            line(4, request_id="chatcmpl-3"),
        ],
        attempts,
        "rec_x",
    )
    assert [(e.line, e.attempt_id, e.detail) for e in result.matched] == [
        (2, "att_1", "by attempt_id"),
        (3, "att_2", "by provider_request_id"),
        (4, "att_3", "by response_id"),
    ]
    assert result.matched[0].expected_usd == D("0.0012")
    assert result.matched_reservations == {"res_1", "res_2", "res_3"}


def test_each_line_lands_in_the_list_its_attempt_calls_for() -> None:
    attempts = [
        attempt(1),
        attempt(2, state="released", settled="0"),
        attempt(3, state="unknown", settled="0"),
        attempt(4, state="held", settled="0"),
        attempt(5, state="unknown_settled", settled="0.0010", settled_by="rec_x"),
        attempt(6, state="unknown_settled", settled="0.0010", settled_by=None),
        attempt(7, settled="0.0100"),
        attempt(8, upstream_request_id="dup"),
        attempt(9, upstream_request_id="dup", endpoint="west"),
    ]
    lines = [
        line(2, "att_1", cost="0.00121"),  # within 1%
        line(3, "att_2", cost="0.0004"),  # released as not started, yet billed
        line(4, "att_3", cost="0.0009"),
        line(5, "att_4"),
        line(6, "att_5", cost="0.0010"),
        line(7, "att_6", cost="0.0030"),
        line(8, "att_7"),
        line(9, "att_1"),  # billed twice
        line(10, request_id="dup"),
        line(11, "att_nowhere", "up_nowhere"),
    ]
    result = classify(lines, attempts, "rec_x")
    assert [e.line for e in result.matched] == [2]
    assert [(e.line, e.expected_usd, e.provider_usd) for e in result.amount_mismatches] == [
        (3, D(0), D("0.0004")),
        (7, D("0.0010"), D("0.0030")),
        (8, D("0.0100"), D("0.0012")),
    ]
    assert "provider billed 0.001200, ledger 0.010000" in str(result.amount_mismatches[2].detail)
    assert "released as not started" in str(result.amount_mismatches[0].detail)
    assert result.to_settle == [Settlement(lines[2], attempts[2], "attempt_id")]
    assert [(e.line, e.expected_usd) for e in result.settled_unknown] == [(6, D("0.0010"))]
    unmatched = {e.line: e.detail or "" for e in result.unmatched_provider_lines}
    assert set(unmatched) == {5, 9, 10, 11}
    assert "still in progress" in unmatched[5]
    assert "already billed on line 2" in unmatched[9]
    assert "matches 2 attempts (endpoints east, west)" in unmatched[10]
    assert unmatched[11] == "no attempt with this attempt_id or provider_request_id"


def test_unmatched_attempts_are_the_billable_ones_no_line_named() -> None:
    attempts = [
        attempt(3),
        attempt(1),
        attempt(2, state="released", settled="0"),
        attempt(4, state="unknown", settled="0"),
        attempt(5, state="held", settled="0"),
        attempt(6, state="unknown_settled", settled="0.0001"),
    ]
    missing = unmatched_attempts(attempts, {"res_3"})
    assert [(e.attempt_id, e.line, e.expected_usd) for e in missing] == [
        ("att_1", None, D("0.0012")),
        ("att_4", None, D("0.0050")),  # what it holds
        ("att_6", None, D("0.0001")),
    ]
    assert missing[0].provider_request_id == "up_1"
    assert missing[0].detail is not None and missing[0].detail.startswith("settled on east")


@settings(max_examples=200, deadline=None)
@given(
    states=st.lists(
        st.sampled_from(["settled", "released", "unknown", "unknown_settled", "held"]),
        min_size=1,
        max_size=8,
    ),
    picks=st.lists(
        st.tuples(st.integers(0, 10), st.sampled_from(["attempt", "request", "response"])),
        max_size=20,
    ),
)
def test_every_line_lands_in_exactly_one_place_and_no_attempt_twice(
    states: list[str], picks: list[tuple[int, str]]
) -> None:
    attempts = [attempt(n, state=s) for n, s in enumerate(states)]
    lines = []
    for number, (n, key) in enumerate(picks, 1):
        if key == "attempt":
            lines.append(line(number, attempt_id=f"att_{n}"))
        else:
            lines.append(
                line(number, request_id=f"up_{n}" if key == "request" else f"chatcmpl-{n}")
            )
    result = classify(lines, attempts, "rec_x")
    placed = [
        *(e.line or 0 for e in result.matched),
        *(e.line or 0 for e in result.amount_mismatches),
        *(e.line or 0 for e in result.settled_unknown),
        *(e.line or 0 for e in result.unmatched_provider_lines),
        *(s.line.line for s in result.to_settle),
    ]
    assert sorted(placed) == list(range(1, len(lines) + 1))
    judged = [
        *(e.attempt_id for e in result.matched),
        *(e.attempt_id for e in result.amount_mismatches),
        *(e.attempt_id for e in result.settled_unknown),
        *(s.attempt.attempt_id for s in result.to_settle),
    ]
    assert len(judged) == len(set(judged))
    missing = {e.attempt_id for e in unmatched_attempts(attempts, result.matched_reservations)}
    assert missing.isdisjoint(judged)


def test_the_id_depends_on_the_file_and_the_scope() -> None:
    digest = "ab" * 32
    ids = {
        reconciliation_id(digest, ReconcileScope()),
        reconciliation_id(digest, ReconcileScope(workspace="acme")),
        reconciliation_id(digest, ReconcileScope(provider="east")),
        reconciliation_id("cd" * 32, ReconcileScope()),
    }
    assert len(ids) == 4
    assert all(i.startswith("rec_") and len(i) == 20 for i in ids)
    assert reconciliation_id(digest, ReconcileScope()) == reconciliation_id(
        digest, ReconcileScope()
    )


# --- the import, on the ledger ---

SPEC = AccountSpec("key:k1:total", "key", "acme", "k1", None, D("10"))


async def _attempt(
    store: EventStore, n: int, *, workspace: str = "acme", cost: str | None = "0.0012"
) -> datetime:
    """One attempt's hold, settled at ``cost`` or (None) held as unknown usage."""
    request_id, attempt_id, reservation_id = f"req_{n}", f"att_{n}", f"res_{n}"
    spec = replace(SPEC, account_id=f"key:{workspace}:total", workspace=workspace)
    hold = Hold(
        reservation_id, request_id, attempt_id, workspace, "k1", "east", "m", D("0.0050"), (), "i"
    )
    reserved = ev.BudgetReserved(
        request_id=request_id,
        attempt_id=attempt_id,
        reservation_id=reservation_id,
        amount_usd=D("0.0050"),
        accounts=(ev.AccountRef(account_id=spec.account_id, kind="key", limit_usd=D(10)),),
        endpoint="east",
        model="m",
        workspace=workspace,
        key_id="k1",
        model_group="chat",
    )
    (recorded,) = await store.append(
        f"request-{request_id}", ANY_VERSION, [reserved], effects=[Reserve(hold, (spec,))]
    )
    usage = ev.Usage(input_tokens=10, output_tokens=5) if cost is not None else None
    finished = ev.AttemptFinished(
        request_id=request_id,
        attempt_id=attempt_id,
        status="succeeded" if usage else "failed",
        evidence=ev.Evidence.STARTED if usage else ev.Evidence.UNKNOWN,
        usage=usage,
        upstream_request_id=f"up_{n}",
        duration_ms=5,
    )
    if usage is not None:
        assert cost is not None
        outcome: ev.Event = ev.BudgetSettled(
            request_id=request_id,
            attempt_id=attempt_id,
            reservation_id=reservation_id,
            reserved_usd=D("0.0050"),
            settled_usd=D(cost),
            released_usd=D("0.0050") - D(cost),
            usage=usage,
        )
        effect: Settle | HoldUnknown = Settle(reservation_id, D(cost))
    else:
        outcome = ev.UnknownUsageOpened(
            settlement_id=f"unk_{n}",
            request_id=request_id,
            attempt_id=attempt_id,
            reservation_id=reservation_id,
            workspace=workspace,
            key_id="k1",
            endpoint="east",
            model="m",
            held_usd=D("0.0050"),
            cause="upstream_unavailable",
        )
        effect = HoldUnknown(reservation_id)
    await store.append(f"request-{request_id}", ANY_VERSION, [finished, outcome], effects=[effect])
    return recorded.recorded_at


def _csv(*rows: tuple[str, str, str, datetime]) -> bytes:
    body = "".join(f"{a},{r},m,10,5,{cost},{at.isoformat()}\n" for a, r, cost, at in rows)
    return (HEADER + body).encode()


async def _ledger(store: EventStore) -> bytes:
    """A settled attempt, an unknown one, another settled one (no line: unmatched), and an
    export naming the first two and an attempt that does not exist."""
    t1 = await _attempt(store, 1)
    t2 = await _attempt(store, 2, cost=None)
    t3 = await _attempt(store, 3)
    export = _csv(("att_1", "", "0.0012", t1), ("", "up_2", "0.0009", t2), ("att_9", "", "1", t3))
    return export


async def _held(store: EventStore, reservation_id: str) -> str:
    async with store.engine.connect() as conn:
        return str(
            (await conn.execute(holds().where(budget_holds.c.reservation_id == reservation_id)))
            .one()
            .state
        )


async def test_an_import_settles_unknown_usage_and_records_its_report(store: EventStore) -> None:
    export = await _ledger(store)
    report = await import_reconciliation(store, export, actor="k_fin")
    assert [e.attempt_id for e in report.matched] == ["att_1"]
    (settled,) = report.settled_unknown
    assert (settled.line, settled.attempt_id, settled.expected_usd) == (3, "att_2", D("0.0009"))
    assert "settled at 0.000900 of 0.005000 held, 0.004100 released" in str(settled.detail)
    assert [e.line for e in report.unmatched_provider_lines] == [4]
    assert [e.attempt_id for e in report.unmatched_attempts] == ["att_3"]
    assert report.imported_by == "k_fin" and report.lines == 3 and report.workspace is None

    trail = await store.read_stream("request-req_2")
    last = trail[-1].event()
    assert isinstance(last, ev.UnknownUsageSettled)
    assert last.source == "reconciliation" and last.reconciliation_id == report.reconciliation_id
    assert last.actor == "k_fin" and last.usage == ev.Usage(input_tokens=10, output_tokens=5)
    assert await _held(store, "res_2") == "resolved"
    async with store.engine.connect() as conn:
        account = (
            await conn.execute(
                sa.select(budget_accounts).where(budget_accounts.c.account_id == "key:acme:total")
            )
        ).one()
    assert account.held_usd == 0 and account.settled_usd == D("0.0012") * 2 + D("0.0009")
    assert await find_reconciliation(store, report.reconciliation_id) == report


async def test_importing_the_same_file_again_changes_nothing(store: EventStore) -> None:
    export = await _ledger(store)
    first = await import_reconciliation(store, export, actor="k_fin")
    head = await store.head()
    again = await import_reconciliation(store, export, actor="someone_else")
    assert again == first
    assert await store.head() == head


async def test_two_imports_racing_record_one_report_and_settle_once(store: EventStore) -> None:
    export = await _ledger(store)
    reports = await asyncio.gather(
        *(import_reconciliation(store, export, actor=f"k_{n}") for n in range(4))
    )
    assert all(r == reports[0] for r in reports)
    assert [e.attempt_id for e in reports[0].settled_unknown] == ["att_2"]
    everything = await store.read_all(limit=10_000)
    assert [e.type for e in everything].count("ReconciliationImported") == 1
    assert [e.type for e in everything].count("UnknownUsageSettled") == 1


async def test_a_bad_file_records_nothing(store: EventStore) -> None:
    await _attempt(store, 1, cost=None)
    head = await store.head()
    bad = HEADER + "att_1,,m,10,5,0.1,2026-11-30T12:00:00Z\natt_1,,m,10,x,0.1,2026-11-30\n"
    with pytest.raises(ExportError, match="line 3, output_tokens"):
        await import_reconciliation(store, bad.encode(), actor="k")
    assert await store.head() == head
    assert await _held(store, "res_1") == "unknown"


async def test_a_workspace_scope_neither_sees_nor_settles_another_workspace(
    store: EventStore,
) -> None:
    export = await _ledger(store)
    report = await import_reconciliation(
        store, export, actor="k_other", scope=ReconcileScope(workspace="other")
    )
    assert report.workspace == "other"
    assert [e.line for e in report.unmatched_provider_lines] == [2, 3, 4]
    assert {e.detail for e in report.unmatched_provider_lines} == {
        "no attempt with this attempt_id or provider_request_id"
    }
    assert not report.matched and not report.settled_unknown and not report.unmatched_attempts
    assert await _held(store, "res_2") == "unknown"
    own = await import_reconciliation(
        store, export, actor="k_acme", scope=ReconcileScope(workspace="acme")
    )
    assert own.reconciliation_id != report.reconciliation_id
    assert [e.attempt_id for e in own.settled_unknown] == ["att_2"]


async def test_an_unknown_settled_by_an_operator_first_is_compared_not_settled_again(
    store: EventStore,
) -> None:
    export = await _ledger(store)
    await settle_unknown(store, "unk_2", D("0.0030"), actor="ops", reason="invoice")
    report = await import_reconciliation(store, export, actor="k_fin")
    assert not report.settled_unknown
    (mismatch,) = report.amount_mismatches
    assert (mismatch.attempt_id, mismatch.expected_usd, mismatch.provider_usd) == (
        "att_2",
        D("0.0030"),
        D("0.0009"),
    )
    assert "unknown usage settled before" in str(mismatch.detail)
    events = [e.type for e in await store.read_stream("request-req_2")]
    assert events.count("UnknownUsageSettled") == 1
