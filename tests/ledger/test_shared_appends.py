"""The workers of `waybill serve --workers N` commit through the first worker's appender
(ledger.store.shared_appends): what one store sends, another commits, and each append's result
goes back, refusals included; when the first cannot be reached its sender commits itself."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import pytest

from ledger.audit.verify import verify_chain
from ledger.books.accounting import BudgetDenied
from ledger.store import NO_STREAM, EventStore, RecordedEvent, WrongExpectedVersion, shared_appends
from ledger.store.db import LedgerUnavailable, create_engine
from ledger.store.shared_appends import AppendClient, AppendServer
from tests.ledger.factories import received
from tests.ledger.test_books import balance, reserve

D = Decimal


@dataclass
class Pair:
    first: EventStore  # commits (the first worker)
    other: EventStore  # sends (another worker)
    server: AppendServer
    client: AppendClient
    path: str


@pytest.fixture
async def pair(database_url: str, tmp_path: Path) -> AsyncIterator[Pair]:
    engines = [create_engine(database_url) for _ in range(2)]
    first, other = (EventStore(engine) for engine in engines)
    path = str(tmp_path / "appends.sock")
    server = AppendServer(first, path)
    await server.start()
    client = AppendClient(path)
    other.forward_to(client)
    yield Pair(first, other, server, client, path)
    await other.close()
    await client.close()
    await first.close()
    await server.close()
    for engine in engines:
        await engine.dispose()


def _told(store: EventStore) -> list[RecordedEvent]:
    told: list[RecordedEvent] = []
    store.on_commit(told.extend)
    return told


async def _settled() -> None:
    await asyncio.sleep(0.05)  # the listeners are told within 10 ms of a commit


async def test_an_append_sent_to_the_first_worker_is_committed_there_and_answered(
    pair: Pair,
) -> None:
    told_first, told_other = _told(pair.first), _told(pair.other)
    mine = await pair.first.append("request-req_0", NO_STREAM, [received("req_0")])
    sent = await pair.other.append(
        "request-req_1", NO_STREAM, [received("req_1")], metadata={"config_generation": "g1"}
    )
    assert pair.client.forwarded_batches == 1
    # The sender gets the events as the ledger holds them, its own data and metadata with them.
    stored = await pair.first.read_all()
    assert [e.position for e in stored] == [mine[0].position, sent[0].position]
    assert sent[0] == stored[1]
    assert sent[0].event() == received("req_1")
    assert sent[0].metadata == {"config_generation": "g1"}
    # Each store's listeners hear of their own appends only (each worker's metrics are its own).
    await _settled()
    assert [e.position for e in told_first] == [mine[0].position]
    assert [e.position for e in told_other] == [sent[0].position]
    assert (await verify_chain(pair.first)).ok


async def test_appends_of_both_workers_at_once_make_one_whole_chain(pair: Pair) -> None:
    await asyncio.gather(
        *(pair.other.append(f"request-o{n}", NO_STREAM, [received(f"o{n}")]) for n in range(20)),
        *(pair.first.append(f"request-f{n}", NO_STREAM, [received(f"f{n}")]) for n in range(20)),
    )
    stored = await pair.first.read_all()
    assert len(stored) == 40 and [e.position for e in stored] == list(range(1, 41))
    assert (await verify_chain(pair.first)).ok


async def test_refusals_come_back_as_themselves(pair: Pair) -> None:
    await pair.other.append("request-req_1", NO_STREAM, [received("req_1")])
    with pytest.raises(WrongExpectedVersion) as moved:
        await pair.other.append("request-req_1", NO_STREAM, [received("req_1")])
    assert (moved.value.stream_id, moved.value.expected, moved.value.actual) == (
        "request-req_1",
        NO_STREAM,
        1,
    )
    events, effect = reserve(2, "0.80")
    await pair.other.append("request-req_2", NO_STREAM, events, effects=[effect])
    events, effect = reserve(3, "0.30")
    with pytest.raises(BudgetDenied) as denied:
        await pair.other.append("request-req_3", NO_STREAM, events, effects=[effect])
    assert denied.value.amount_usd == D("0.30") and denied.value.available_usd == D("0.20")
    assert await balance(pair.first) == (D("0.80"), D(0))
    assert pair.client.forwarded_batches == 4


async def test_with_no_first_worker_a_worker_commits_itself_and_tries_again_later(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shared_appends, "RETRY_AFTER_S", 0.2)
    engines = [create_engine(database_url) for _ in range(2)]
    first, other = (EventStore(engine) for engine in engines)
    path = str(tmp_path / "appends.sock")
    client = AppendClient(path)
    other.forward_to(client)
    server = AppendServer(first, path)
    try:
        await other.append("request-req_1", NO_STREAM, [received("req_1")])
        assert client.forwarded_batches == 0  # nobody listens: committed through its own
        await server.start()
        await other.append("request-req_2", NO_STREAM, [received("req_2")])
        assert client.forwarded_batches == 0  # not tried again before the back-off ends
        await asyncio.sleep(0.25)
        await other.append("request-req_3", NO_STREAM, [received("req_3")])
        assert client.forwarded_batches == 1
        assert [e.stream_id for e in await first.read_all()] == [
            "request-req_1",
            "request-req_2",
            "request-req_3",
        ]
    finally:
        await other.close()
        await client.close()
        await first.close()
        await server.close()
        for engine in engines:
            await engine.dispose()


async def test_a_first_worker_that_is_stopping_sends_the_batch_back(pair: Pair) -> None:
    await pair.other.append("request-req_1", NO_STREAM, [received("req_1")])
    await pair.first.close()  # what a stopping worker does before its server ends
    recorded = await pair.other.append("request-req_2", NO_STREAM, [received("req_2")])
    assert pair.client.forwarded_batches == 1  # the second was committed by its sender
    assert [e.stream_id for e in await pair.other.read_all()] == ["request-req_1", "request-req_2"]
    assert recorded[0].version == 1


async def test_a_first_worker_gone_while_the_sender_was_idle_costs_no_append(
    pair: Pair,
) -> None:
    await pair.other.append("request-req_1", NO_STREAM, [received("req_1")])
    await pair.first.close()
    await pair.server.close()  # its connections end: the sender, idle, sees them closed
    await asyncio.sleep(0.05)
    await pair.other.append("request-req_2", NO_STREAM, [received("req_2")])
    assert pair.client.forwarded_batches == 1
    assert [e.stream_id for e in await pair.other.read_all()] == ["request-req_1", "request-req_2"]


async def test_a_batch_whose_answer_never_comes_fails_as_the_ledger_unavailable(
    database_url: str, tmp_path: Path
) -> None:
    path = str(tmp_path / "appends.sock")

    async def take_and_vanish(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # a first worker that dies with the batch
        writer.close()

    vanishing = await asyncio.start_unix_server(take_and_vanish, path=path)
    engine = create_engine(database_url)
    other = EventStore(engine)
    client = AppendClient(path)
    other.forward_to(client)
    try:
        with pytest.raises(LedgerUnavailable, match="went away with a batch"):
            await other.append("request-req_1", NO_STREAM, [received("req_1")])
        # Never sent twice: whether it committed is the caller's to find out.
        assert await other.read_all() == []
        vanishing.close()
        # The next batch is not sent there again before the back-off: committed here.
        await other.append("request-req_2", NO_STREAM, [received("req_2")])
        assert [e.stream_id for e in await other.read_all()] == ["request-req_2"]
    finally:
        await other.close()
        await client.close()
        await engine.dispose()
