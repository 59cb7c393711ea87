"""Proofs for one request: every event of its stream a signed checkpoint covers, each with an
inclusion proof against that checkpoint, checkable with no database and no network
(contract §7 "Proofs").

A proof document is one JSON object, written in canonical form (sorted keys, no spaces,
UTF-8) with one final newline, hashes in lowercase hex:

    {"checkpoint": {...the signed checkpoint, as in the sink...},
     "events": [{"inclusion_proof": [hex, ...], "leaf_hash": hex, "payload": base64,
                 "position": 57, "type": "RequestReceived", "version": 1}, ...],
     "format": "waybill-proof/v2", "request_id": "req_...",
     "stream": {"first_version": 1, "key_id": hex, "last_version": 8, "signature": hex}}

``payload`` is the event's stored canonical bytes, byte for byte (standard base64). Whoever
checks it recomputes each leaf hash from the position and those bytes, walks its inclusion
proof up to the checkpoint's root (RFC 9162 §2.1.3.2) and checks the checkpoint's signature
with the operator's public key: then these exact bytes are in the history the operator
signed, at these positions. Every byte of the document is covered: the informational fields
must match the payload, base64 must be in its canonical form, and the document must be
exactly the canonical bytes of what it says, so a reformatted or edited document is refused.

Inclusion alone cannot show that no event is missing: the first four events of a request
of eight are each in the tree. So ``stream`` states the request stream's version range that
the checkpoint covers (every version at or before its size) and the leaf hashes of exactly
those events, signed by the operator's key as the gateway issues the proof
(:func:`stream_statement`); a document with events cut, or with events and range cut
together, fails. That statement is the issuer's word, not a consequence of the tree: a
verifier trusts the key's holder to state the range as the ledger held it.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import orjson
from sqlalchemy.ext.asyncio import AsyncEngine

from ledger.audit.checkpoints import (
    Checkpoint,
    CheckpointFormatError,
    PublicKeys,
    SigningKey,
    checkpoint_from_json,
)
from ledger.audit.merkle import (
    Frontier,
    PerfectSource,
    blocks,
    event_leaf_hash,
    inclusion_ranges,
    range_hash,
    verify_inclusion,
)
from ledger.audit.sink import SinkEntry, TreeFiles
from ledger.store import RecordedEvent
from ledger.store.db import READ_ONLY
from ledger.store.stored import read_range
from ledger.views.queries import request_stream_id

__all__ = [
    "FORMAT",
    "ProofInvalid",
    "ProofSummary",
    "ProofUnavailable",
    "build_proof",
    "check_proof",
    "choose_checkpoint",
    "prove_from_tree",
    "stream_statement",
]

FORMAT: Final = "waybill-proof/v2"
STATEMENT: Final = "waybill-proof-stream/v1"
_OLD_FORMATS: Final = frozenset({"waybill-proof/v1"})
_HASH: Final = re.compile(r"[0-9a-f]{64}")
_KEY_ID: Final = re.compile(r"[0-9a-f]{16}")
_SIGNATURE: Final = re.compile(r"[0-9a-f]{128}")
_FIELDS: Final = frozenset({"format", "request_id", "checkpoint", "events", "stream"})
_STREAM_FIELDS: Final = frozenset({"first_version", "last_version", "key_id", "signature"})
_EVENT_FIELDS: Final = frozenset(
    {"position", "version", "type", "leaf_hash", "payload", "inclusion_proof"}
)
_PAGE: Final = 5000


class ProofUnavailable(Exception):
    """No proof can be made (yet): no checkpoint covers the request, or the ledger does not
    match the checkpoint."""


class ProofInvalid(ValueError):
    """A proof document that does not prove what it says; the message names what failed."""


@dataclass(frozen=True, slots=True)
class ProofSummary:
    request_id: str
    types: tuple[str, ...]
    checkpoint: Checkpoint
    stream_key_id: str  # the key that signed the stream's range


def stream_statement(
    request_id: str,
    checkpoint: Checkpoint,
    first_version: int,
    last_version: int,
    leaf_hashes: Sequence[str],
    key_id: str,
) -> bytes:
    """The bytes a proof's ``stream`` signature covers (ASCII, each line ending in a
    newline): the statement format, the request id and its stream id (JSON strings, so no
    id can forge a line), the checkpoint's size and root, the first and last version of the
    stream at or before that size, the leaf hash of each of those versions in order, and
    the signing key's id."""
    lines = [
        STATEMENT,
        orjson.dumps(request_id).decode("utf-8"),
        orjson.dumps(request_stream_id(request_id)).decode("utf-8"),
        str(checkpoint.size),
        checkpoint.root,
        str(first_version),
        str(last_version),
        *leaf_hashes,
        key_id,
    ]
    return "".join(f"{line}\n" for line in lines).encode("utf-8")


# --- making one -----------------------------------------------------------------------------


def choose_checkpoint(entries: Sequence[SinkEntry], size: int | None = None) -> Checkpoint:
    """The checkpoint of ``size``, or the largest; ProofUnavailable if there is none."""
    found = [e.checkpoint for e in entries if e.checkpoint is not None]
    if size is not None:
        found = [c for c in found if c.size == size]
        if not found:
            raise ProofUnavailable(f"no checkpoint of size {size}")
        return found[0]
    if not found:
        raise ProofUnavailable("no checkpoint has been taken yet")
    return max(found, key=lambda c: c.size)


async def build_proof(
    engine: AsyncEngine,
    request_id: str,
    trail: Sequence[RecordedEvent],
    checkpoint: Checkpoint,
    tree: TreeFiles | None,
    key: SigningKey,
    *,
    scan: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> bytes:
    """The proof document of ``trail`` (the request's events, in order, read after
    ``checkpoint`` was chosen: it then holds every event the checkpoint covers) against
    ``checkpoint``, its stream range signed with ``key``. Its nodes come from the sink's
    tree files when they reach that far, else (``scan``) from a pass over the ledger up to
    the checkpoint's size."""
    trail = _covered(trail, checkpoint)
    paths = _paths(trail, checkpoint)
    made: list[dict[str, Any]] | int = 0
    if tree is not None and tree.leaves >= checkpoint.size:
        made = await asyncio.to_thread(_entries, trail, checkpoint, paths, tree.perfect)
    if isinstance(made, int) and scan:
        # No tree files, or tree files of another sink: the nodes from the ledger itself.
        wanted = {
            (height, start >> height)
            for ranges in paths.values()
            for first, end in ranges
            for start, height in blocks(first, end)
        }
        caught = await _catch(engine, checkpoint.size, wanted, progress)

        def perfect(start: int, height: int) -> bytes | None:
            return caught.get((height, start >> height))

        made = _entries(trail, checkpoint, paths, perfect)
    return _document(request_id, checkpoint, made, key)


def prove_from_tree(
    request_id: str,
    trail: Sequence[RecordedEvent],
    checkpoint: Checkpoint,
    tree: TreeFiles,
    key: SigningKey,
) -> bytes:
    """:func:`build_proof` from the sink's tree files alone (no pass over the ledger):
    a few hundred reads of files, made in a worker thread by the HTTP route."""
    if tree.leaves < checkpoint.size:
        raise ProofUnavailable(f"the sink's tree files do not reach size {checkpoint.size}")
    trail = _covered(trail, checkpoint)
    made = _entries(trail, checkpoint, _paths(trail, checkpoint), tree.perfect)
    return _document(request_id, checkpoint, made, key)


def _covered(trail: Sequence[RecordedEvent], checkpoint: Checkpoint) -> list[RecordedEvent]:
    """The stream's events the checkpoint covers: its prefix at or before the checkpoint's
    size (a stream's versions follow its positions)."""
    covered = [e for e in trail if e.position <= checkpoint.size]
    if not covered:
        first = min((e.position for e in trail), default=0)
        raise ProofUnavailable(
            f"the checkpoint of size {checkpoint.size} does not cover position {first} yet"
        )
    if [e.version for e in covered] != list(range(1, len(covered) + 1)):
        # Not the stream from its first version on (an archived month, a read of part of
        # it): no range could be stated truthfully.
        raise ProofUnavailable("the request's events at hand are not its stream from version 1")
    return covered


def _paths(
    trail: Sequence[RecordedEvent], checkpoint: Checkpoint
) -> dict[int, list[tuple[int, int]]]:
    return {e.position: inclusion_ranges(e.position - 1, checkpoint.size) for e in trail}


def _document(
    request_id: str, checkpoint: Checkpoint, made: list[dict[str, Any]] | int, key: SigningKey
) -> bytes:
    if isinstance(made, int):
        raise ProofUnavailable(
            f"the ledger's event at position {made} is not the one the checkpoint of size "
            f"{checkpoint.size} signed: run `waybill verify --checkpoints`"
        )
    first, last = made[0]["version"], made[-1]["version"]
    leaves = [entry["leaf_hash"] for entry in made]
    statement = stream_statement(request_id, checkpoint, first, last, leaves, key.key_id)
    document = {
        "format": FORMAT,
        "request_id": request_id,
        "checkpoint": checkpoint.as_json(),
        "events": made,
        "stream": {
            "first_version": first,
            "last_version": last,
            "key_id": key.key_id,
            "signature": key.signature(statement),
        },
    }
    return orjson.dumps(document, option=orjson.OPT_SORT_KEYS) + b"\n"


def _entries(
    trail: Sequence[RecordedEvent],
    checkpoint: Checkpoint,
    paths: dict[int, list[tuple[int, int]]],
    perfect: PerfectSource,
) -> list[dict[str, Any]] | int:
    """The document's events, each proof checked against the signed root; or the first
    position whose proof does not lead there."""
    root = bytes.fromhex(checkpoint.root)
    entries = []
    for event in trail:
        leaf = event_leaf_hash(event.position, event.payload)
        hashes = [range_hash(first, end, perfect) for first, end in paths[event.position]]
        proof = [h for h in hashes if h is not None]
        if len(proof) != len(hashes) or not verify_inclusion(
            event.position - 1, checkpoint.size, leaf, proof, root
        ):
            return event.position
        entries.append(
            {
                "position": event.position,
                "version": event.version,
                "type": event.type,
                "leaf_hash": leaf.hex(),
                "payload": base64.b64encode(event.payload).decode("ascii"),
                "inclusion_proof": [p.hex() for p in proof],
            }
        )
    return entries


async def _catch(
    engine: AsyncEngine,
    size: int,
    wanted: set[tuple[int, int]],
    progress: Callable[[int, int], None] | None,
) -> dict[tuple[int, int], bytes]:
    """The wanted nodes, from a pass over the ledger's positions 1 .. ``size``."""
    frontier = Frontier(watch=wanted)
    async with engine.connect() as conn:
        reading = await conn.execution_options(**{READ_ONLY: True})
        while frontier.size < size:
            found = await read_range(reading, frontier.size, size, _PAGE)
            if not found:
                break
            for position, _, payload in found:
                if position != frontier.size + 1:
                    raise ProofUnavailable(f"the ledger has no event at {frontier.size + 1}")
                frontier.append(event_leaf_hash(position, payload))
            if progress is not None:
                progress(frontier.size, size)
    if frontier.size < size:
        raise ProofUnavailable(
            f"the ledger ends at position {frontier.size}, before the checkpoint's {size}"
        )
    return frontier.caught


# --- checking one ---------------------------------------------------------------------------


def check_proof(document: bytes, keys: PublicKeys) -> ProofSummary:
    """Check a proof document alone; ProofInvalid names the first thing that fails."""
    try:
        value = orjson.loads(document)
    except orjson.JSONDecodeError:
        raise ProofInvalid("the document is not JSON") from None
    if isinstance(value, dict) and value.get("format") in _OLD_FORMATS:
        raise ProofInvalid(
            f"format {value['format']!r} does not bind the request's whole stream (its events "
            "could be cut unseen): make the proof again with `waybill prove`"
        )
    if not isinstance(value, dict) or set(value) != _FIELDS:
        raise ProofInvalid(f"a proof has exactly the fields {sorted(_FIELDS)}")
    if orjson.dumps(value, option=orjson.OPT_SORT_KEYS) + b"\n" != document:
        raise ProofInvalid(
            "the document is not in the canonical form `waybill prove` writes (sorted keys, "
            "no spaces, one final newline): it was changed"
        )
    if value["format"] != FORMAT:
        raise ProofInvalid(f"format is not {FORMAT!r}")
    request_id = value["request_id"]
    if not isinstance(request_id, str) or not request_id:
        raise ProofInvalid("request_id is not a request id")
    try:
        checkpoint = checkpoint_from_json(value["checkpoint"])
    except CheckpointFormatError as error:
        raise ProofInvalid(f"the checkpoint is not one: {error}") from None
    problem = keys.problem(checkpoint)
    if problem is not None:
        raise ProofInvalid(f"the checkpoint is {problem}")
    trail = value["events"]
    if not isinstance(trail, list) or not trail:
        raise ProofInvalid("events is not a non-empty list")
    root = bytes.fromhex(checkpoint.root)
    types = []
    previous = 0
    for number, entry in enumerate(trail, start=1):
        event_type = _check_event(entry, number, request_id, checkpoint, root, previous)
        previous = entry["position"]
        types.append(event_type)
    key_id = _check_stream(value["stream"], request_id, checkpoint, trail, keys)
    return ProofSummary(request_id, tuple(types), checkpoint, key_id)


def _check_stream(
    stream: Any, request_id: str, checkpoint: Checkpoint, trail: list[Any], keys: PublicKeys
) -> str:
    """The signed range holds, and the events are exactly its versions (each event's own
    version was checked to follow on from 1): none missing, none cut with the range."""
    if not isinstance(stream, dict) or set(stream) != _STREAM_FIELDS:
        raise ProofInvalid(f"stream has not exactly the fields {sorted(_STREAM_FIELDS)}")
    first, last = stream["first_version"], stream["last_version"]
    key_id, signature = stream["key_id"], stream["signature"]
    if type(first) is not int or type(last) is not int or not 1 <= first <= last:
        raise ProofInvalid("the stream's version range is not one (first <= last, from 1)")
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
        raise ProofInvalid("the stream's key_id is not a key id")
    if not isinstance(signature, str) or not _SIGNATURE.fullmatch(signature):
        raise ProofInvalid("the stream's signature is not an Ed25519 signature in hex")
    stream_id = request_stream_id(request_id)
    carried = (trail[0]["version"], trail[-1]["version"])
    if carried != (first, last):
        missing = f"{carried[1] + 1}..{last}" if carried[0] == first else "some"
        raise ProofInvalid(
            f"the proof carries versions {carried[0]}..{carried[1]} of {stream_id}, but its "
            f"range says versions {first}..{last} are the stream's events up to position "
            f"{checkpoint.size}: events {missing} are missing"
        )
    leaves = [str(entry["leaf_hash"]) for entry in trail]
    statement = stream_statement(request_id, checkpoint, first, last, leaves, key_id)
    problem = keys.signature_problem(key_id, statement, signature)
    if problem is not None:
        raise ProofInvalid(
            f"the range of {stream_id} (versions {first}..{last} up to position "
            f"{checkpoint.size}) does not hold: {problem}; the range or the events were changed"
        )
    return key_id


def _check_event(
    entry: Any, number: int, request_id: str, checkpoint: Checkpoint, root: bytes, previous: int
) -> str:
    if not isinstance(entry, dict) or set(entry) != _EVENT_FIELDS:
        raise ProofInvalid(f"event {number} has not exactly the fields {sorted(_EVENT_FIELDS)}")
    position, version, event_type = entry["position"], entry["version"], entry["type"]
    name = f"event {number} (position {position}, {event_type})"
    if type(position) is not int or not previous < position <= checkpoint.size:
        raise ProofInvalid(
            f"{name}: the position is not after the one before and within the checkpoint"
        )
    payload = _base64(entry["payload"], name)
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise ProofInvalid(f"{name}: the payload is not the stored JSON of an event") from None
    if not isinstance(body, dict):
        raise ProofInvalid(f"{name}: the payload is not the stored JSON of an event")
    if body.get("stream_id") != request_stream_id(request_id):
        raise ProofInvalid(f"{name}: the payload is not an event of request {request_id}")
    if type(version) is not int or body.get("version") != version or version != number:
        raise ProofInvalid(f"{name}: the version is not {number}, the next of the stream")
    if body.get("type") != event_type:
        raise ProofInvalid(f"{name}: the type is not the payload's")
    leaf = event_leaf_hash(position, payload)
    if entry["leaf_hash"] != leaf.hex():
        raise ProofInvalid(f"{name}: leaf_hash is not the hash of its position and payload")
    proof = entry["inclusion_proof"]
    if not isinstance(proof, list) or not all(
        isinstance(p, str) and _HASH.fullmatch(p) for p in proof
    ):
        raise ProofInvalid(f"{name}: the inclusion proof is not a list of hashes")
    hashes = [bytes.fromhex(p) for p in proof]
    if not verify_inclusion(position - 1, checkpoint.size, leaf, hashes, root):
        raise ProofInvalid(f"{name}: its inclusion proof does not lead to the checkpoint's root")
    return str(event_type)


def _base64(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise ProofInvalid(f"{name}: the payload is not base64")
    try:
        decoded = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ProofInvalid(f"{name}: the payload is not base64") from None
    if base64.b64encode(decoded).decode("ascii") != value:
        raise ProofInvalid(f"{name}: the payload is not in canonical base64")
    return decoded
