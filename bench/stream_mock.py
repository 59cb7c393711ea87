"""The bench mock: an OpenAI-compatible provider that answers every chat completion with a long
paced stream, for ``bench/streams_bench.py``.

    .venv/bin/python bench/stream_mock.py [--port 0] [--chunks 50] [--delay-ms 20]

Every ``POST .../chat/completions`` gets ``200 text/event-stream``: the role chunk at once,
then ``--chunks`` content chunks ``--delay-ms`` apart, then, ``--delay-ms`` after the last,
the finish chunk, the usage chunk and ``[DONE]`` in one write (as OpenAI ends a stream), each
on a schedule fixed at the stream's start, to the millisecond (a late write does not delay
the ones after it). The chunks are OpenAI's shape and size. Prints
``listening http://HOST:PORT`` first.

It is not the fake provider (``router.fake_provider``), which injects faults and pays for it
with a task and a timeout per event (about 140 us of CPU an event, more than the gateway it
would measure): here each connection is one asyncio protocol, and the streams' writes due in
the same millisecond share one timer callback, a few microseconds an event, so that on a
shared 2-core machine the load is the gateway's and not the mock's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
import time
from typing import Final

import httptools
import orjson

_HEAD: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n"
)
_WORDS: Final = (" stream", "ing", " is", " how", " long", " answers", " arrive", ",")
_ids = itertools.count(1)


def _chunk(payload: bytes) -> bytes:
    """One HTTP chunk holding one SSE event."""
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(event), event)


def _event(chunk_id: str, created: int, delta: dict[str, str], finish: str | None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return _chunk(
        orjson.dumps(
            {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": "fake-model",
                "system_fingerprint": "fp_mock",
                "choices": [choice],
                "usage": None,
            }
        )
    )


def _script(chunks: int) -> list[bytes]:
    """The writes of one stream: the role chunk, each content chunk, and the end."""
    chunk_id, created = f"chatcmpl-mock{next(_ids):08d}", int(time.time())
    writes = [_event(chunk_id, created, {"role": "assistant", "content": ""}, None)]
    for i in range(chunks):
        writes.append(_event(chunk_id, created, {"content": _WORDS[i % len(_WORDS)]}, None))
    usage = {"prompt_tokens": 12, "completion_tokens": chunks, "total_tokens": 12 + chunks}
    end = {
        "id": chunk_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": "fake-model",
        "system_fingerprint": "fp_mock",
        "choices": [],
        "usage": usage,
    }
    finish = _event(chunk_id, created, {}, "stop")
    writes.append(finish + _chunk(orjson.dumps(end)) + _chunk(b"[DONE]") + b"0\r\n\r\n")
    return writes


class _Pacer:
    """The streams' next writes, by the millisecond they are due: one timer per due
    millisecond shared by every stream due then, not one per chunk of every stream (at
    1,000 streams, 50,000 timers made and run a second were most of the mock's CPU:
    ``bench/README.md``, "Long streams"). A stream's writes keep their spacing: all that
    were due together are due together again ``delay`` later."""

    def __init__(self, delay_s: float) -> None:
        self._delay_ms = max(1, round(delay_s * 1000))
        self._due: dict[int, list[tuple[_Connection, list[bytes], int]]] = {}

    def after_delay(self, conn: _Connection, writes: list[bytes], index: int) -> None:
        loop = asyncio.get_running_loop()
        self._add(int(loop.time() * 1000) + self._delay_ms, conn, writes, index)

    def _add(self, tick: int, conn: _Connection, writes: list[bytes], index: int) -> None:
        due = self._due.get(tick)
        if due is None:
            due = self._due[tick] = []
            asyncio.get_running_loop().call_at(tick / 1000, self._fire, tick)
        due.append((conn, writes, index))

    def _fire(self, tick: int) -> None:
        next_tick = tick + self._delay_ms
        for conn, writes, index in self._due.pop(tick, ()):
            if conn.write(writes, index):
                self._add(next_tick, conn, writes, index + 1)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one stream at a time, written by the shared pacer."""

    def __init__(self, chunks: int, pacer: _Pacer) -> None:
        self._chunks = chunks
        self._pacer = pacer
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None  # the pacer's next write for it finds it gone

    def on_message_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()
        writes = _script(self._chunks)
        if self._transport is not None:
            self._transport.write(_HEAD + b"\r\n" + writes[0])
            self._pacer.after_delay(self, writes, 1)

    def write(self, writes: list[bytes], index: int) -> bool:
        """Write the stream's ``index``-th write; whether another is to follow."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return False
        transport.write(writes[index])
        if index + 1 < len(writes):
            return True
        if not self._keep_alive:
            transport.close()
        return False


async def _serve(host: str, port: int, chunks: int, delay_ms: float) -> None:
    loop = asyncio.get_running_loop()
    pacer = _Pacer(delay_ms / 1000)
    server = await loop.create_server(lambda: _Connection(chunks, pacer), host, port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    print(f"listening http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=50)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        run = asyncio.run
    else:
        run = uvloop.run
    with contextlib.suppress(KeyboardInterrupt):
        run(_serve(args.host, args.port, args.chunks, args.delay_ms))


if __name__ == "__main__":
    main()
