"""Putting one Behavior on the wire: latency, error responses, bodies, streams and the faults
that break them (RST, early close, cut streams, silence, bad events, awkward writes).

Stream faults never cut after the event that carries the finish reason: a cut stream has no
finish reason, and a complete one ends with the terminating HTTP chunk.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from router.fake_provider._http import Connection, HttpRequest
from router.fake_provider._reply import Dialect, Prompt, Reply, SseEvent, dumps, frame, make_reply
from router.fake_provider.behavior import ERROR_KINDS, Behavior, Kind

__all__ = ["Exchange", "respond", "send_json", "split_awkwardly"]

JSON = "application/json"
# `after_events` for kinds built without one (e.g. from JSON).
_DEFAULT_AFTER = {
    Kind.MID_STREAM_DISCONNECT: 2,
    Kind.MALFORMED_EVENT: 1,
    Kind.STALL: 0,
    Kind.ERROR_EVENT: 1,
}
# Kinds that cut a body: a stream after `after_events` events, a buffered one halfway.
_CUTTING = frozenset({Kind.MID_STREAM_DISCONNECT, Kind.STALL})


@dataclass(frozen=True)
class Exchange:
    """One inference request being answered."""

    conn: Connection
    request: HttpRequest
    dialect: Dialect
    prompt: Prompt
    behavior: Behavior
    upstream: str
    request_id: str
    # Called when the client leaves before the response is complete.
    on_client_gone: Callable[[], None]
    # The partial assistant text the request continues (a continuation the fake accepted).
    partial: str | None = None
    # Told of each answer begun, which the fake bills (its admin API's usage).
    on_reply: Callable[[Reply], None] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {self.dialect.request_id_header: self.request_id, "x-fake-upstream": self.upstream}


def split_awkwardly(data: bytes) -> list[bytes]:
    """Cut `data` inside every multibyte UTF-8 character and around every CR and LF."""
    cuts = {0, len(data)}
    for i, byte in enumerate(data):
        if byte >= 0xC0:  # lead byte of a multibyte character: cut right after it
            cuts.add(i + 1)
        elif byte in (0x0A, 0x0D):
            cuts.update((i, i + 1))
    return [data[a:b] for a, b in itertools.pairwise(sorted(cuts)) if b > a]


async def send_json(
    conn: Connection,
    status: int,
    body: object,
    *,
    keep_alive: bool,
    headers: dict[str, str] | None = None,
) -> None:
    all_headers = {"content-type": JSON, **(headers or {})}
    await conn.send_response(status, all_headers, dumps(body).encode(), keep_alive=keep_alive)


async def respond(ex: Exchange) -> None:
    """Answer the request as `ex.behavior` says."""
    behavior, conn = ex.behavior, ex.conn
    conn.body_sent = 0
    if behavior.latency_ms and await conn.wait_client_gone(behavior.latency_ms / 1000):
        ex.on_client_gone()
        await conn.close()
        return
    kind = behavior.kind
    if kind is Kind.RESET_BEFORE_BYTES:
        conn.reset()
    elif kind is Kind.STALL and behavior.after_events is None and behavior.after_content is None:
        await _stall(ex)
    elif kind in ERROR_KINDS:
        error = ex.dialect.error(behavior, ex.prompt, ex.request_id)
        headers = {**ex.headers, **error.headers}
        await send_json(
            conn, error.status, error.body, keep_alive=ex.request.keep_alive, headers=headers
        )
    else:
        message_id = f"{ex.dialect.message_id_prefix}{ex.request_id.removeprefix('req_')}"
        reply = make_reply(ex.upstream, ex.request_id, message_id, ex.prompt, behavior, ex.partial)
        if ex.on_reply is not None:
            ex.on_reply(reply)
        if ex.prompt.stream:
            await _stream(ex, reply)
        else:
            await _buffered(ex, reply)


async def _stall(ex: Exchange) -> None:
    """Go silent; close when the stall ends, unless the client left first."""
    if await ex.conn.wait_client_gone(ex.behavior.stall_s):
        ex.on_client_gone()
    await ex.conn.close()


async def _buffered(ex: Exchange, reply: Reply) -> None:
    conn, kind = ex.conn, ex.behavior.kind
    data = dumps(ex.dialect.body(reply)).encode()
    if kind is Kind.MALFORMED_EVENT:
        data = data[: len(data) // 2]  # a 200 whose body is not JSON
    keep_alive = ex.request.keep_alive
    head = Connection.head(
        200,
        {
            **ex.headers,
            "content-type": JSON,
            "content-length": str(len(data)),
            "connection": "keep-alive" if keep_alive else "close",
        },
    )
    if kind is Kind.DISCONNECT_BEFORE_FIRST_EVENT:
        await conn.send(head)
        await conn.close()
    elif kind in _CUTTING:
        # Headers and half the promised body, then silence or a close.
        await conn.send(head + data[: len(data) // 2], body=len(data) // 2)
        await (_stall(ex) if kind is Kind.STALL else conn.close())
    elif kind is Kind.SPLIT_UTF8:
        await conn.send(head)
        for piece in split_awkwardly(data):
            await conn.send(piece, body=len(piece))
            await asyncio.sleep(ex.behavior.split_delay_ms / 1000)
    else:
        await conn.send(head + data, body=len(data))
    if not keep_alive:
        await conn.close()


async def _stream(ex: Exchange, reply: Reply) -> None:
    conn, behavior = ex.conn, ex.behavior
    kind = behavior.kind
    script = ex.dialect.stream(reply, ex.prompt)
    sse_headers = {
        **ex.headers,
        "content-type": "text/event-stream; charset=utf-8",
        "cache-control": "no-cache",
    }
    await conn.start_chunked(200, sse_headers, keep_alive=ex.request.keep_alive)
    if kind is Kind.DISCONNECT_BEFORE_FIRST_EVENT:
        await conn.close()
        return
    if behavior.after_content is not None:
        after = script.content_index + behavior.after_content
    elif behavior.after_events is not None:
        after = behavior.after_events
    else:
        after = _DEFAULT_AFTER.get(kind, 0)
    after = min(after, script.finish_index)
    cut = after if kind in _CUTTING or kind is Kind.ERROR_EVENT else None
    malformed_at = after if kind is Kind.MALFORMED_EVENT else None
    held: list[bytes] | None = [] if behavior.one_write else None

    async def emit(event: SseEvent) -> None:
        data = frame(event, behavior.line_ending)
        if held is None:
            await _emit(ex, data)
        else:
            held.append(data)  # one_write: all of it goes out at the end, in one send

    for i, event in enumerate(script.events):
        if i == cut or (kind is Kind.NO_DONE and i == script.done_index):
            break
        delay_ms = behavior.first_event_delay_ms if i == 0 else behavior.chunk_delay_ms
        if delay_ms and await conn.wait_client_gone(delay_ms / 1000):
            ex.on_client_gone()
            await conn.close()
            return
        if i == malformed_at:
            await emit(ex.dialect.malformed(reply))
        await emit(event)
    if kind is Kind.ERROR_EVENT:
        await emit(ex.dialect.error_event())
    if held:
        await conn.send_chunk(b"".join(held))
    if kind is Kind.STALL:
        await _stall(ex)
    elif kind is Kind.MID_STREAM_DISCONNECT:
        await conn.close()
    else:
        await conn.end_chunked()
        if not ex.request.keep_alive:
            await conn.close()


async def _emit(ex: Exchange, data: bytes) -> None:
    if ex.behavior.kind is not Kind.SPLIT_UTF8:
        await ex.conn.send_chunk(data)
        return
    # One HTTP chunk and one socket write per piece, with a pause so that each leaves as its
    # own TCP segment and the client's reader really sees the pieces apart.
    for piece in split_awkwardly(data):
        await ex.conn.send_chunk(piece)
        await asyncio.sleep(ex.behavior.split_delay_ms / 1000)
