"""``GET /v1/requests/{id}/proof`` (contract §3, §7): a request's events with an inclusion proof
of each against a signed checkpoint, the document ``waybill prove`` writes.

A thin edge: the request-reading rules of :mod:`router.http.access` (a request the caller may
not read is the same 404 as one that does not exist), the checkpoints of the sink this
gateway writes (the config's ``checkpoints.out``), the proof from :mod:`ledger.audit.proofs`
built from the sink's tree files in a worker thread, its stream range signed with the config's
``checkpoints.signing_key`` (never a pass over the ledger on the
request's behalf). No checkpoint configured, or none covering the request yet: 409
``proof_unavailable``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Final

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ledger.audit.checkpoints import Checkpoint, SigningKey
from ledger.audit.proofs import ProofUnavailable, prove_from_tree
from ledger.audit.sink import SinkError, TreeFiles, find_checkpoint
from ledger.events import RequestReceived
from ledger.store import EventStore, RecordedEvent
from ledger.views.queries import read_request_events
from router.config import Config
from router.errors import invalid_request, proof_unavailable, request_not_found
from router.http import openapi as api_doc
from router.http.access import can_read_request
from router.request.gateway import Caller

__all__ = ["proof_router", "prove_as"]

_MAX_SIZE: Final = 2**63 - 1

Authenticate = Callable[[Request], Awaitable[Caller]]


def proof_router(authenticate: Authenticate, serving_config: Callable[[], Config]) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/requests/{request_id}/proof", openapi_extra=api_doc.REQUEST_PROOF)
    async def request_proof(request_id: str, request: Request) -> Response:
        caller = await authenticate(request)
        size = _size(request.query_params)
        store: EventStore = request.app.state.store
        document = await prove_as(caller, store, serving_config(), request_id, size)
        return Response(document, media_type="application/json")

    return router


async def prove_as(
    caller: Caller, store: EventStore, config: Config, request_id: str, size: int | None
) -> bytes:
    """The request's proof document, if ``caller`` may read the request (the same 404 as for
    one that does not exist otherwise); 409 ``proof_unavailable`` when no checkpoint of this
    gateway's sink covers it."""
    trail = await read_request_events(store.engine, request_id)
    received = trail[0].event() if trail else None
    if not isinstance(received, RequestReceived) or not can_read_request(
        caller, received.workspace, received.key_id
    ):
        raise request_not_found(request_id)
    settings = config.checkpoints
    if settings is None:
        raise proof_unavailable("this gateway takes no checkpoints (config: checkpoints)")
    try:
        checkpoint = await asyncio.to_thread(_checkpoint, settings.out, size)
        # Read again now the checkpoint is chosen: events appended since the first read may
        # be in it, and the proof's signed range must hold every event it covers.
        trail = await read_request_events(store.engine, request_id)
        return await asyncio.to_thread(
            _prove, request_id, trail, settings.out, checkpoint, settings.key
        )
    except (SinkError, ProofUnavailable) as error:
        raise proof_unavailable(f"no proof of request {request_id!r}: {error}") from None


def _checkpoint(sink: Path, size: int | None) -> Checkpoint:
    checkpoint = find_checkpoint(sink, size)
    if checkpoint is None:
        raise ProofUnavailable(
            "no checkpoint has been taken yet" if size is None else f"no checkpoint of size {size}"
        )
    return checkpoint


def _prove(
    request_id: str,
    trail: Sequence[RecordedEvent],
    sink: Path,
    checkpoint: Checkpoint,
    key: SigningKey,
) -> bytes:
    tree = TreeFiles(sink)
    try:
        return prove_from_tree(request_id, trail, checkpoint, tree, key)
    finally:
        tree.close()


def _size(params: Mapping[str, str]) -> int | None:
    raw = params.get("size")
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= _MAX_SIZE:
        raise invalid_request(f"size must be a checkpoint's tree size, not {raw!r}", param="size")
    return int(raw)
