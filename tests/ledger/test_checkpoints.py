"""Signed checkpoints outside the database (contract §7), on both backends: what the
database's superuser can no longer rewrite unseen, and proofs anyone can check offline."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import text

from ledger.audit import checkpointer as checkpointer_module
from ledger.audit.checkpoint_audit import CheckpointAudit
from ledger.audit.checkpointer import Checkpointer, LedgerMismatch, Schedule
from ledger.audit.checkpoints import Checkpoint, PublicKeys, SigningKey, generate_key
from ledger.audit.merkle import Frontier, event_leaf_hash, hash_leaf
from ledger.audit.proofs import ProofInvalid, check_proof, stream_statement
from ledger.audit.sink import LEVELS, SinkBusy, find_checkpoint, read_sink
from ledger.store import NO_STREAM, EventStore
from ledger.store.db import create_engine
from tests.helpers import eventually
from tests.ledger.factories import succeeded_trail
from tests.ledger.tamper import cut_tail, rewrite_event
from tests.ledger.test_cli import waybill


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[EventStore]:
    engine = create_engine(database_url)
    store = EventStore(engine)
    yield store
    await store.close()
    await engine.dispose()


@pytest.fixture
def keys(tmp_path: Path) -> tuple[SigningKey, Path, Path]:
    key = generate_key()
    private, public = tmp_path / "signing.key", tmp_path / "signing.pub"
    private.write_bytes(key.private_pem())
    public.write_bytes(key.public_pem())
    return key, private, public


async def _requests(store: EventStore, first: int, count: int) -> None:
    for i in range(first, first + count):
        await store.append(f"request-r{i}", NO_STREAM, succeeded_trail(f"r{i}"))


async def _checkpoint(store: EventStore, key: SigningKey, sink: Path) -> Checkpoint:
    checkpointer = Checkpointer(store, key, sink)
    try:
        await checkpointer.open()
        return await checkpointer.take()
    finally:
        await checkpointer.close()


async def _position_of(store: EventStore, request_id: str, event_type: str) -> int:
    trail = await store.read_stream(f"request-{request_id}")
    return next(e.position for e in trail if e.type == event_type)


def _verify(url: str, sink: Path, *public: Path, as_json: bool = False) -> tuple[int, str]:
    args = ["verify", "--checkpoints", str(sink)]
    for key in public:
        args += ["--public-key", str(key)]
    result = waybill(*args, *(["--json"] if as_json else []), database_url=url)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, result.stdout


def _settled_more(data: dict[str, str]) -> dict[str, str]:
    return {**data, "settled_usd": str(Decimal(data["settled_usd"]) * 2)}


@pytest.mark.parametrize("rewritten", ["before the first checkpoint", "after it"])
async def test_a_superuser_rewrite_with_a_recomputed_chain_fails_the_checkpoints(
    database_url: str, store: EventStore, keys, tmp_path: Path, rewritten: str
) -> None:
    key, _, public = keys
    sink = tmp_path / "sink"
    await _requests(store, 0, 4)
    first = await _checkpoint(store, key, sink)
    await _requests(store, 4, 4)
    second = await _checkpoint(store, key, sink)
    code, output = _verify(database_url, sink, public)
    assert code == 0 and "checkpoints OK: 2 signed tree sizes" in output, output
    assert "each consistent with the one before" in output

    # A bill line rewritten: the settlement doubled, data and bytes alike, every later hash
    # and the head recomputed. The hash chain cannot tell.
    request = "r1" if rewritten == "before the first checkpoint" else "r6"
    position = await _position_of(store, request, "BudgetSettled")
    assert (position <= first.size) == (request == "r1")
    rewrite_event(database_url, position, _settled_more)
    plain = waybill("verify", database_url=database_url)
    assert plain.returncode == 0 and "ledger OK" in plain.stdout

    failing = first if request == "r1" else second
    code, output = _verify(database_url, sink, public)
    assert code == 1
    assert f"checkpoint FAILED: checkpoints-{failing.time[:10]}.jsonl:" in output
    assert f"(size {failing.size}, key {key.key_id})" in output
    assert f"first differing position: {position}" in output
    assert f"checkpoint signed {failing.root}" in output
    assert "not consistent" not in output  # the signed checkpoints are one history

    code, output = _verify(database_url, sink, public, as_json=True)
    answer = json.loads(output)
    assert code == 1 and answer["ok"] is False and answer["checked"] == second.size + 1
    assert answer["checkpoints"]["failure"]["first_differing_position"] == position
    assert answer["checkpoints"]["failure"]["size"] == failing.size

    # A copy of the checkpoint lines alone (no tree files) narrows it down honestly.
    copy = tmp_path / "copy"
    copy.mkdir()
    for line_file in sink.glob("*.jsonl"):
        shutil.copy(line_file, copy)
    code, output = _verify(database_url, copy, public)
    assert code == 1
    if failing is first:
        assert f"the first differing position is between 1 and {failing.size} (no tree" in output
    else:
        assert (
            f"the first differing position is between {first.size + 1} and {failing.size}, "
            "if it extends the checkpoint before it (no tree files" in output
        )


async def test_a_cut_tail_with_the_head_moved_back_fails_the_checkpoints(
    database_url: str, store: EventStore, keys, tmp_path: Path
) -> None:
    key, _, public = keys
    sink = tmp_path / "sink"
    await _requests(store, 0, 3)
    checkpoint = await _checkpoint(store, key, sink)
    keep = checkpoint.size - 5
    cut_tail(database_url, keep)
    plain = waybill("verify", database_url=database_url)
    assert plain.returncode == 0 and f"head at position {keep}" in plain.stdout

    code, output = _verify(database_url, sink, public)
    assert code == 1
    assert f"the ledger ends at position {keep}" in output
    assert f"first differing position: {keep + 1}" in output


async def test_checkpoints_need_a_given_key_and_every_byte_of_them_counts(
    database_url: str, store: EventStore, keys, tmp_path: Path
) -> None:
    key, _, public = keys
    sink = tmp_path / "sink"
    await _requests(store, 0, 2)
    await _checkpoint(store, key, sink)
    rotated = generate_key()
    rotated_public = tmp_path / "rotated.pub"
    rotated_public.write_bytes(rotated.public_pem())
    await _requests(store, 2, 1)
    await _checkpoint(store, rotated, sink)

    # Keys rotate: both given, both checkpoints hold; one missing, its checkpoint fails.
    assert _verify(database_url, sink, public, rotated_public)[0] == 0
    code, output = _verify(database_url, sink, public)
    assert code == 1
    assert f"signed by key {rotated.key_id}, which is not one of the public keys" in output
    stranger = tmp_path / "stranger.pub"
    stranger.write_bytes(generate_key().public_pem())
    code, output = _verify(database_url, sink, stranger)
    assert code == 1 and "not one of the public keys given" in output

    # Any one byte of the checkpoint file changed, the newlines included: refused.
    trusted = PublicKeys([key.public, rotated.public])
    assert not CheckpointAudit(read_sink(sink, strict=True), trusted, None).refused
    for line_file in sorted(sink.glob("*.jsonl")):
        original = line_file.read_bytes()
        for at in range(len(original)):
            for flip in (0x01, 0x20):
                changed = bytearray(original)
                changed[at] ^= flip
                line_file.write_bytes(bytes(changed))
                audit = CheckpointAudit(read_sink(sink, strict=True), trusted, None)
                assert audit.refused, (at, flip, bytes(changed))
        line_file.write_bytes(original)
    line_file = sorted(sink.glob("*.jsonl"))[0]
    original = line_file.read_bytes()
    changed = bytearray(original)
    changed[original.index(b',"time":') - 1] ^= 0x01  # the last digit of the first size
    line_file.write_bytes(bytes(changed))
    code, output = _verify(database_url, sink, public, rotated_public)
    assert code == 1 and "its signature does not verify" in output
    line_file.write_bytes(original)
    assert _verify(database_url, sink, public, rotated_public)[0] == 0


async def test_a_checkpoint_over_a_forked_history_is_not_consistent_with_the_one_before(
    database_url: str, store: EventStore, keys, tmp_path: Path
) -> None:
    key, _, public = keys
    sink = tmp_path / "sink"
    await _requests(store, 0, 3)
    first = await _checkpoint(store, key, sink)
    await _requests(store, 3, 2)
    head, head_hash = await store.head()
    # The operator's own key signs, with its tree files, a history in which position 3 was
    # different: the two signed trees are not one history.
    fork = tmp_path / "fork"
    (fork / "tree").mkdir(parents=True)
    shutil.copy(sink / f"checkpoints-{first.time[:10]}.jsonl", fork)
    forked = Frontier(keep=LEVELS)
    for event in await store.read_all(limit=10_000):
        leaf = event_leaf_hash(event.position, event.payload)
        forked.append(hash_leaf(b"forged") if event.position == 3 else leaf)
    for level, nodes in forked.kept.items():
        (fork / "tree" / f"{level:02d}.hashes").write_bytes(b"".join(nodes))
    signed = key.sign(head, forked.root().hex(), head_hash, "2999-01-01T00:00:00.000000Z")
    (fork / "checkpoints-2999-01-01.jsonl").write_bytes(signed.line())

    code, output = _verify(database_url, fork, public)
    assert code == 1
    assert f"checkpoints-2999-01-01.jsonl:1 (size {head}" in output
    before = f"checkpoints-{first.time[:10]}.jsonl:1 (size {first.size})"
    assert f"it is not consistent with {before}: the two signed trees are not one" in output
    assert "first differing position: 3" in output

    # The checkpoint lines alone cannot show it, and the report says what it assumes.
    shutil.rmtree(fork / "tree")
    code, output = _verify(database_url, fork, public)
    assert code == 1 and "not consistent" not in output
    assert f"between {first.size + 1} and {head}, if it extends the checkpoint before" in output


async def test_a_proof_verifies_offline_and_any_one_byte_change_in_it_fails(
    database_url: str, store: EventStore, keys, tmp_path: Path
) -> None:
    key, private, public = keys
    sink = tmp_path / "sink"
    signed = ("--signing-key", str(private))
    await _requests(store, 0, 5)
    early = await _checkpoint(store, key, sink)
    await _requests(store, 5, 3)
    latest = await _checkpoint(store, key, sink)

    proved = waybill("prove", "r6", "--checkpoints", str(sink), *signed, database_url=database_url)
    assert proved.returncode == 0, proved.stderr
    document = proved.stdout.encode()
    proof = json.loads(document)
    assert proof["checkpoint"]["size"] == latest.size
    assert [e["version"] for e in proof["events"]] == list(range(1, len(proof["events"]) + 1))
    proof_file = tmp_path / "proof.json"
    proof_file.write_bytes(document)
    checked = waybill(
        "verify-proof", str(proof_file), "--public-key", str(public), database_url="x://"
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"proof OK: request r6: {len(proof['events'])} events" in checked.stdout
    assert f"tree of size {latest.size}, signed by key {key.key_id}" in checked.stdout
    assert f"every event of its stream up to position {latest.size}" in checked.stdout

    # Without the tree files the proof is made by a pass over the ledger: the same bytes.
    copy = tmp_path / "copy"
    copy.mkdir()
    for line_file in sink.glob("*.jsonl"):
        shutil.copy(line_file, copy)
    again = waybill("prove", "r6", "--checkpoints", str(copy), *signed, database_url=database_url)
    assert again.returncode == 0 and again.stdout.encode() == document

    trusted = PublicKeys([key.public])
    assert check_proof(document, trusted).request_id == "r6"
    for at in range(len(document)):
        changed = bytearray(document)
        changed[at] ^= 0x01
        with pytest.raises(ProofInvalid):
            check_proof(bytes(changed), trusted)
    changed = bytearray(document)
    changed[document.index(b'"payload":"') + 20] ^= 0x01
    proof_file.write_bytes(bytes(changed))
    failed = waybill(
        "verify-proof", str(proof_file), "--public-key", str(public), database_url="x://"
    )
    assert failed.returncode == 1 and "proof FAILED: event " in failed.stdout
    proof_file.write_bytes(document)
    stranger = tmp_path / "stranger.pub"
    stranger.write_bytes(generate_key().public_pem())
    failed = waybill(
        "verify-proof", str(proof_file), "--public-key", str(stranger), database_url="x://"
    )
    assert failed.returncode == 1 and "not one of the public keys given" in failed.stdout

    # Against an earlier checkpoint that covers the request, and one that does not.
    at_early = ("--checkpoints", str(sink), *signed, "--size", str(early.size))
    older = waybill("prove", "r1", *at_early, database_url=database_url)
    assert older.returncode == 0 and json.loads(older.stdout)["checkpoint"]["size"] == early.size
    too_early = waybill("prove", "r6", *at_early, database_url=database_url)
    assert too_early.returncode == 1
    assert f"checkpoint of size {early.size} does not cover position" in too_early.stderr

    # A rewritten event can no longer be proved.
    rewrite_event(database_url, await _position_of(store, "r6", "BudgetSettled"), _settled_more)
    refused = waybill("prove", "r6", "--checkpoints", str(sink), *signed, database_url=database_url)
    assert refused.returncode == 1 and "is not the one the checkpoint" in refused.stderr


def _canonical(value: dict[str, Any]) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS) + b"\n"


async def test_a_proof_carries_the_whole_stream_the_checkpoint_covers_and_a_cut_one_fails(
    database_url: str, store: EventStore, keys, tmp_path: Path
) -> None:
    key, private, public = keys
    sink = tmp_path / "sink"
    await _requests(store, 0, 3)
    taken = await _checkpoint(store, key, sink)
    # An event of r1 after the checkpoint: the proof is of the stream's covered prefix.
    events = await store.read_stream("request-r1")
    await store.append("request-r1", len(events), succeeded_trail("r1")[-1:])
    proved = waybill(
        "prove", "r1", "--checkpoints", str(sink), "--signing-key", str(private),
        database_url=database_url,
    )  # fmt: skip
    assert proved.returncode == 0, proved.stderr
    whole = orjson.loads(proved.stdout)
    count = len(whole["events"])
    assert count == len(events) >= 4
    assert whole["stream"] == {
        "first_version": 1,
        "last_version": count,
        "key_id": key.key_id,
        "signature": whole["stream"]["signature"],
    }
    assert max(e["position"] for e in whole["events"]) <= taken.size

    def verify(document: dict[str, Any]) -> tuple[int, str]:
        proof_file = tmp_path / "proof.json"
        proof_file.write_bytes(_canonical(document))
        result = waybill(
            "verify-proof", str(proof_file), "--public-key", str(public), database_url="x://"
        )
        assert "Traceback" not in result.stderr, result.stderr
        return result.returncode, result.stdout

    code, output = verify(whole)
    assert code == 0 and f"proof OK: request r1: {count} events" in output, output

    # The request's later events cut: each one left is in the tree, but the range says more.
    half = count // 2
    cut = {**whole, "events": whole["events"][:half]}
    code, output = verify(cut)
    assert code == 1
    assert f"proof FAILED: the proof carries versions 1..{half} of request-r1" in output
    assert f"events {half + 1}..{count} are missing" in output

    # The range cut with them: its signature covered the whole range and every leaf.
    cut_range = {**cut, "stream": {**whole["stream"], "last_version": half}}
    code, output = verify(cut_range)
    assert code == 1
    assert f"proof FAILED: the range of request-r1 (versions 1..{half} up to position" in output
    assert f"does not hold: its signature does not verify with key {key.key_id}" in output

    # One event left out of the middle: the versions no longer follow on.
    gap = {**whole, "events": whole["events"][:1] + whole["events"][2:]}
    code, output = verify(gap)
    assert code == 1 and "the version is not 2, the next of the stream" in output

    # A range signed by a key the verifier does not trust is refused.
    stranger = generate_key()
    leaves = [e["leaf_hash"] for e in cut["events"]]
    statement = stream_statement("r1", taken, 1, half, leaves, stranger.key_id)
    forged = {
        **cut,
        "stream": {
            "first_version": 1,
            "last_version": half,
            "key_id": stranger.key_id,
            "signature": stranger.signature(statement),
        },
    }
    code, output = verify(forged)
    assert code == 1 and "which is not one of the public keys given" in output

    # A proof of the old format, without a range, is refused for what it cannot show.
    old = {k: v for k, v in whole.items() if k != "stream"}
    code, output = verify({**old, "format": "waybill-proof/v1"})
    assert code == 1 and "does not bind the request's whole stream" in output

    # Without the signing key, no proof is made.
    unsigned = waybill("prove", "r1", "--checkpoints", str(sink), database_url=database_url)
    assert unsigned.returncode == 2 and "--signing-key" in unsigned.stderr


async def test_the_writer_takes_up_from_its_last_checkpoint_and_drops_unsigned_tree_data(
    database_url: str, store: EventStore, keys, tmp_path: Path
) -> None:
    key, _, public = keys
    sink = tmp_path / "sink"
    await _requests(store, 0, 40)  # over 256 events: a node of level 8 in the tree files
    first = await _checkpoint(store, key, sink)
    assert (sink / "tree" / "08.hashes").stat().st_size == 32 * (first.size >> 8)
    # A crash after the tree files grew and before the checkpoint's line was written.
    with (sink / "tree" / "00.hashes").open("ab") as file:
        file.write(b"\x07" * 32 * 3 + b"\x01")
    await _requests(store, 40, 2)
    second = await _checkpoint(store, key, sink)
    assert (sink / "tree" / "00.hashes").stat().st_size == 32 * second.size
    assert len(read_sink(sink)) == 2
    assert _verify(database_url, sink, public)[0] == 0

    # One writer at a time.
    holder = Checkpointer(store, key, sink)
    await holder.open()
    with pytest.raises(SinkBusy):
        await Checkpointer(store, key, sink).open()
    await holder.close()

    # And never on top of a ledger rewritten under its last checkpoint.
    rewrite_event(database_url, await _position_of(store, "r1", "BudgetSettled"), _settled_more)
    with pytest.raises(LedgerMismatch, match=f"head hash {second.head_hash} at position"):
        await Checkpointer(store, key, sink).open()


async def test_the_schedule_counts_events_and_seconds_but_not_its_own_records(
    store: EventStore, keys, tmp_path: Path
) -> None:
    key = keys[0]
    sink = tmp_path / "sink"
    per_request = len(succeeded_trail("r"))

    def lines() -> list[int]:
        return [e.checkpoint.size for e in read_sink(sink) if e.checkpoint] if sink.exists() else []

    async def running(schedule: Schedule) -> tuple[asyncio.Event, asyncio.Task[None]]:
        stop = asyncio.Event()
        return stop, asyncio.create_task(Checkpointer(store, key, sink).run(schedule, stop))

    # By events alone: the clock is never due.
    stop, task = await running(Schedule(every_events=2 * per_request, every_seconds=3600))
    await _requests(store, 0, 1)
    await asyncio.sleep(1.5)  # nothing to await: a checkpoint must not come
    assert lines() == []
    await _requests(store, 1, 1)
    await eventually(lambda: _true(len(lines()) == 1), within_s=5)
    await asyncio.sleep(1.5)  # idle: its own CheckpointTaken is not worth a checkpoint
    stop.set()
    await task
    assert lines() == [2 * per_request]

    # By seconds alone, once anything was appended; and once more when it stops.
    stop, task = await running(Schedule(every_events=10**6, every_seconds=0.2))
    await _requests(store, 2, 1)
    await eventually(lambda: _true(len(lines()) == 2), within_s=5)
    await asyncio.sleep(0.6)
    assert len(lines()) == 2
    await _requests(store, 3, 1)
    stop.set()
    await task
    head, _ = await store.head()
    assert len(lines()) == 3 and lines()[-1] == head - 1  # all but its own last record


async def _true(value: bool) -> bool:
    return value


def test_a_sinks_checkpoint_is_found_without_reading_every_day_file(tmp_path: Path) -> None:
    key = generate_key()
    days = {"2026-01-01": [5, 9], "2026-01-02": [12, 20]}
    for day, sizes in days.items():
        lines = [
            key.sign(size, "a" * 64, "b" * 64, f"{day}T00:00:0{i}.000000Z").line()
            for i, size in enumerate(sizes)
        ]
        (tmp_path / f"checkpoints-{day}.jsonl").write_bytes(b"".join(lines) + b'{"size": 2')

    def size(wanted: int | None) -> int | None:
        found = find_checkpoint(tmp_path, wanted)
        return None if found is None else found.size

    assert size(None) == 20  # the unfinished line is passed over
    assert [size(s) for s in (5, 9, 12, 20)] == [5, 9, 12, 20]
    assert find_checkpoint(tmp_path, 10) is None and find_checkpoint(tmp_path, 21) is None


async def test_the_readmes_checkpoint_walkthrough_runs_as_written(
    database_url: str, store: EventStore, tmp_path: Path
) -> None:
    # README "Tamper evidence": keygen, a checkpoint into a folder that does not exist yet
    # (its parents neither), verify, prove, verify-proof, each line as the README gives it.
    await _requests(store, 0, 3)
    keys, sink = tmp_path / "keys", tmp_path / "mnt" / "worm" / "waybill"
    made = waybill("checkpoint", "keygen", "--out", str(keys), database_url=database_url)
    assert made.returncode == 0, made.stderr
    (private,) = keys.glob("checkpoint-*.key")
    (public,) = keys.glob("checkpoint-*.pub")
    taken = waybill(
        "checkpoint", "--signing-key", str(private), "--out", str(sink), database_url=database_url
    )
    assert taken.returncode == 0, taken.stderr
    assert _verify(database_url, sink, public)[0] == 0
    proved = waybill(
        "prove",
        "r1",
        "--checkpoints",
        str(sink),
        "--signing-key",
        str(private),
        database_url=database_url,
    )
    assert proved.returncode == 0, proved.stderr
    proof = tmp_path / "proof.json"
    proof.write_text(proved.stdout)
    checked = waybill("verify-proof", str(proof), "--public-key", str(public), database_url="x://")
    assert checked.returncode == 0 and "proof OK: request r1" in checked.stdout, checked.stderr

    # The README's lines name the key files by the same folder each time.
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme[readme.index("waybill checkpoint keygen --out keys") :].split("```")[0]
    assert "keys/checkpoint-<id>.pub" in block.split("verify-proof")[1].splitlines()[0]


async def test_a_hole_longer_than_a_page_stops_the_checkpointer(
    store: EventStore,
    database_url: str,
    keys: tuple[SigningKey, Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A page reads the rows up to its last position only, so a hole longer than a page
    # leaves a page with nothing after the frontier: still an edit, never signed over.
    monkeypatch.setattr(checkpointer_module, "_PAGE", 2)
    await _requests(store, 0, 3)
    rows = [position async for position in _row_positions(store)]
    async with store.engine.begin() as conn:
        if database_url.startswith("postgresql"):
            await conn.execute(text("ALTER TABLE appends DISABLE TRIGGER USER"))
        else:
            await conn.execute(text("DROP TRIGGER IF EXISTS appends_no_delete"))
        await conn.execute(text("DELETE FROM appends WHERE position = :p"), {"p": rows[1]})
    assert rows[2] - rows[1] > 2  # the hole is longer than a page
    with pytest.raises(LedgerMismatch, match=f"no event at position {rows[1]} "):
        await _checkpoint(store, keys[0], tmp_path / "sink")


async def _row_positions(store: EventStore) -> AsyncIterator[int]:
    async with store.engine.connect() as conn:
        for (position,) in await conn.execute(text("SELECT position FROM appends ORDER BY 1")):
            yield int(position)
