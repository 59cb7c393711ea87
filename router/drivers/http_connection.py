"""One pooled HTTP/1.1 connection: an asyncio Protocol that writes a request and parses its
response with httptools (llhttp), buffering the body for the task that reads it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final, cast

import httptools

from router.drivers.http_messages import ConnectionBroken, HTTPError, ProtocolError, ReadTimeout
from router.support.unread import unread_bytes

__all__ = ["Connection"]

log = logging.getLogger("waybill.http")

_HIGH_WATER: Final = 256 * 1024  # unread body bytes buffered before reading pauses


class Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and the one exchange in flight on it (no pipelining).

    The protocol callbacks and the httptools callbacks fill the exchange's state; the task
    that reads the response waits on :meth:`wait` and is woken by every change.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False  # the peer closed it, it failed, or we closed it
        self.idle_since = 0.0
        # The read timeout of the wait in progress: its deadline (the response's own, if
        # that comes first: `_absolute`), and one timer that may be due earlier than it
        # (then it re-arms) but never later (see `wait`).
        self._read_timeout: float | None = None
        self._deadline: float | None = None
        self._absolute = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._begin(in_flight=False)

    def _begin(self, *, in_flight: bool) -> None:
        self.in_flight = in_flight
        self.status_code = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.error: HTTPError | None = None
        self._close_delimited = False
        self._interim = False
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._on_end: Callable[[], None] | None = None  # set while the rest is discarded
        self._drain_timer: asyncio.TimerHandle | None = None
        self.tap: Callable[[bytes], bool] | None = None  # see Response.tap
        self._tapped: list[bytes] = []  # the read being parsed, for the tap

    # --- the exchange, driven by the client ---

    def discard_rest(self, on_end: Callable[[], None], within_s: float) -> None:
        """Drop the rest of the body as it arrives and call ``on_end`` when the response
        ends; if it has not ended within ``within_s``, drop the connection instead."""
        self.chunks, self.buffered = [], 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        if self.complete:
            on_end()
            return
        self._on_end = on_end
        self._drain_timer = self._loop.call_later(within_s, self.abort)

    def send(self, data: bytes) -> None:
        assert self._transport is not None
        self._begin(in_flight=True)
        self._transport.write(data)

    async def wait(self, read_timeout: float | None, deadline: float | None = None) -> None:
        """Until the next change of the exchange, or :class:`ReadTimeout` when it does not
        come within ``read_timeout`` or by ``deadline`` (the loop's time).

        A stream waits once per read of its body: rather than a timer per wait (made and
        cancelled each time, most of a read's timer cost), the connection keeps one, armed
        for the first deadline and moved on when it fires early (`_on_timer`)."""
        waiter = self._waiter = self._loop.create_future()
        self._read_timeout = read_timeout
        at = None if read_timeout is None else self._loop.time() + read_timeout
        self._absolute = deadline is not None and (at is None or deadline < at)
        if self._absolute:
            at = deadline
        self._deadline = at
        if at is not None and (self._timer is None or self._timer_at > at):
            self._arm(at)
        try:
            await waiter
        finally:
            self._waiter = None

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(at, self._on_timer), at

    def _on_timer(self) -> None:
        self._timer = None
        waiter, deadline, timeout = self._waiter, self._deadline, self._read_timeout or 0.0
        if waiter is None or waiter.done() or deadline is None:
            return  # not waiting: the next wait arms it again
        now = self._loop.time()
        if now < deadline:
            self._arm(deadline)
        elif unread_bytes(self._transport):
            # The response's bytes are here, the loop has not read them yet (router.support.unread):
            # not a silence of the upstream's. They are read before this fires again.
            later = now if self._absolute else now + timeout
            self._deadline = later
            self._arm(later)
        elif self._absolute:
            waiter.set_exception(ReadTimeout("no response bytes by the deadline", deadline=True))
        else:
            waiter.set_exception(ReadTimeout("no response bytes within the read timeout"))

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def take(self) -> bytes:
        """The body bytes buffered so far (there are some), reading resumed if paused."""
        chunks = self.chunks
        piece = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return piece

    def close(self) -> None:
        self.closed, self.in_flight = True, False
        self._disarm()
        if self._transport is not None:
            self._transport.close()

    def abort(self) -> None:
        """Drop the connection now: whatever is left of its exchange must never be read."""
        self.closed, self.in_flight = True, False
        self._disarm()
        self._on_end = None
        self.tap = None
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        if self._transport is not None:
            self._transport.abort()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: HTTPError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self.abort()
        self._wake()

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though uvloop's do not subclass asyncio.Transport.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.in_flight:
            # Bytes nobody asked for on an idle connection: its framing is lost.
            self.abort()
            return
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.complete:
                # Bytes after a whole response: it stands, the connection is not reused.
                self.keep_alive = False
            else:
                self._fail(ProtocolError(f"malformed response: {exc}"))
        if self._tapped:
            self._offer()

    def _offer(self) -> None:
        """The body pieces of the read just parsed, to the tap together, as the reader
        would have taken them together (one parse and one write for several events)."""
        pieces, self._tapped = self._tapped, []
        piece = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        tap, taken = self.tap, False
        if tap is not None:
            try:
                taken = tap(piece)
            except Exception:  # a bug in the taker: the reader gets the piece instead
                log.exception("a tap of an upstream body failed")
        if taken:
            # Taken as it came: the reader's wait goes on, its silence starts again.
            if self._read_timeout is not None and not self._absolute:
                self._deadline = self._loop.time() + self._read_timeout
            return
        self.tap = None
        self._buffer(piece)

    def eof_received(self) -> bool | None:
        self._peer_closed(None)
        return None  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self._peer_closed(exc)

    def _peer_closed(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.in_flight or self.complete or self.error is not None:
            return
        if self.headers_done and self._close_delimited and exc is None:
            # RFC 9112 §6.3: without Content-Length or chunking, the close ends the body.
            self.complete = True
        else:
            how = "reset" if exc is not None else "closed"
            when = "mid-body" if self.headers_done else "before the response headers"
            self.error = ConnectionBroken(f"connection {how} by the upstream {when}")
        self._wake()

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        if self.complete:
            raise ProtocolError("bytes after the end of the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        prior = self.headers.get(key)
        self.headers[key] = text if prior is None else f"{prior}, {text}"

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            self._interim = True  # 100 Continue, 103 Early Hints: the real one follows
            self.headers = {}
            return
        self.status_code = status
        self._close_delimited = (
            "content-length" not in self.headers
            and "chunked" not in self.headers.get("transfer-encoding", "").lower()
            and status not in (204, 304)
        )
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self._on_end is not None:
            return  # the reader is gone; the rest is only read to free the connection
        if self.tap is not None and not self.chunks:  # behind buffered pieces: not tapped
            self._tapped.append(body)  # offered once the whole read is parsed
            return
        self._buffer(body)

    def _buffer(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        # False for HTTP/1.0 and for "Connection: close" (llhttp's reading of both).
        self.keep_alive = self._parser.should_keep_alive()
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            if self._drain_timer is not None:
                self._drain_timer.cancel()
            on_end()
        self._wake()
