"""The answer as it goes out: a committed stream sent to the client (:class:`EventStream`),
cancelled when the client disconnects, recorded for an Idempotency-Key, and replayed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Mapping,
    MutableMapping,
)
from typing import Any, Final, TypeVar

from fastapi.responses import Response

from router.adapters.idempotency import Claim, IdempotencyStore, RecordedAnswer
from router.request.gateway import Gateway
from router.serving.server import BODY_EXTENSION, HANGUP_EXTENSION, BodyWriter, Hangup

_SSE: Final = "text/event-stream"
_MAX_RECORDED_STREAM: Final = 8 * 1024 * 1024

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


T = TypeVar("T")


class ClientGone(Exception):
    pass


async def unless_disconnected(scope: Scope, receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` in this task; if the client disconnects first, cancel it (the gateway
    records the attempt in flight as ``client_canceled``, and the upstream call is dropped)
    and raise :class:`ClientGone`. Served by Waybill's own protocol, the server calls back
    on a hang-up (``router.serving.server``); under another server, a task waits on ``receive``
    (a second task for the work as well, and waiting on both, cost more: ``bench/README.md``,
    "Decisions")."""
    this = asyncio.current_task()
    assert this is not None
    gone = False

    def hang_up() -> None:
        nonlocal gone
        gone = True
        this.cancel()

    watch: Hangup | None = scope.get("extensions", {}).get(HANGUP_EXTENSION, {}).get("watch")
    unwatch = (watch or _watch_receive(receive))(hang_up)
    try:
        return await work
    except asyncio.CancelledError:
        if gone:
            this.uncancel()  # our cancellation, not one from outside: the request ends here
            raise ClientGone from None
        raise
    finally:
        unwatch()
        if gone and this.cancelling():  # the work ended before our cancellation reached it
            this.uncancel()


def _watch_receive(receive: Receive) -> Hangup:
    """A :data:`Hangup` for any ASGI server: a task reading the next message."""

    def watch(callback: Callable[[], None]) -> Callable[[], None]:
        def done(task: asyncio.Future[None]) -> None:
            if not task.cancelled() and task.exception() is None:
                callback()

        task = asyncio.ensure_future(_disconnected(receive))
        task.add_done_callback(done)

        def unwatch() -> None:
            task.remove_done_callback(done)
            task.cancel()

        return unwatch

    return watch


async def _disconnected(receive: Receive) -> None:
    # The body has been read: the next message from the server is the disconnect (or,
    # once the response is complete, the end of the exchange).
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """The committed stream, sent as it comes; a client that disconnects cancels it.

    What Starlette's StreamingResponse does, without its anyio task group: delivering the
    group's cancellation polls the task on every turn of the loop, a cost every streamed
    request paid (``bench/README.md``, "Decisions")."""

    media_type = _SSE

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        headers: Mapping[str, str],
        *,
        on_end: Callable[[], None],
        direct: Callable[[BodyWriter], None] | None = None,
    ) -> None:
        self._body = body
        self._on_end = on_end
        self._direct = direct
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(ClientGone):
            await unless_disconnected(scope, receive, self._send(scope, send))

    async def _send(self, scope: Scope, send: Send) -> None:
        body = self._body
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            # Served by Waybill's protocol, reads the gateway passes on unchanged are written
            # straight from the upstream connection's callback (router.serving.server
            # BODY_EXTENSION).
            writer = scope.get("extensions", {}).get(BODY_EXTENSION, {}).get("write")
            if writer is not None and self._direct is not None:
                self._direct(writer)
            async for piece in body:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                del piece  # not held while the next one is awaited: most of a stream's life
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # Cancelled while sending, the body is left at a yield: close it now, so that
            # its own cleanup (the request's end on the ledger) runs at once.
            try:
                await body.aclose()
            finally:
                self._on_end()


def replay(answer: RecordedAnswer) -> Response:
    headers = {**answer.headers, "x-request-id": answer.request_id, "idempotent-replayed": "true"}
    return Response(
        answer.body,
        status_code=answer.status_code,
        media_type=answer.content_type,
        headers=headers,
    )


async def recorded(
    body: AsyncIterator[bytes],
    idempotency: IdempotencyStore,
    claim: Claim,
    headers: dict[str, str],
    gateway: Gateway,
) -> AsyncGenerator[bytes, None]:
    """The committed stream's bytes, for an Idempotency-Key: the answer is recorded before
    its last piece goes out, so a client that saw the whole stream and retries gets the
    replay, never a 409. Each piece is held until the next one exists (one piece of delay,
    paid only by idempotent streams)."""
    recorded: list[bytes] | None = []
    size = 0
    held: bytes | None = None
    completed = False
    try:
        async for piece in body:
            if held is not None:
                yield held
            held = piece
            if recorded is not None:
                size += len(piece)
                if size <= _MAX_RECORDED_STREAM:
                    recorded.append(piece)
                else:
                    recorded = None
        if recorded is not None:
            answer = RecordedAnswer(claim.request_id, 200, _SSE, headers, b"".join(recorded))
            await idempotency.finish(claim, answer)
            completed = True
        if held is not None:
            yield held
    finally:
        if not completed:
            # Cut short by the client (or too long to keep): a retry runs again.
            gateway._keep(idempotency.abandon(claim))
