"""Closed-loop HTTP/1.1 load generator for the gateway benchmark, run in its own process.

    .venv/bin/python bench/loadgen.py --url http://127.0.0.1:8900/v1/chat/completions \\
        --model fake-model --concurrency 16 --seconds 5 [--stream] [--api-key KEY] [--requests N]
        [--header 'NAME: VALUE' ...]

C keep-alive connections each send one chat completion, wait for the whole response
(a Content-Length body, or a chunked SSE stream to its last chunk), and send the next. After
``--warmup`` seconds the measured window opens; at its end (or once ``--requests`` have been
sent) no new request is sent and the ones in flight are awaited, so every request sent is
answered and counted (the gateway benchmark checks the ledger against ``sent``). Prints one
JSON object.

With ``--ramp S`` the workers start one after another over S seconds rather than all at
once (keep it within ``--warmup``). For streams it also times the first content (the first
``"content":"`` with text in the body: time to first token, TTFT), counts each stream's
events (``data:`` lines), and counts the streams and events completed inside the window
(long streams finish after it; ``bench/streams_bench.py`` reads those). A connection that
closes before its response is whole is ``lost`` (not one byte of the response came) or
``cut`` (part of it came).

Deliberately tiny (asyncio protocols and a minimal response parser, no HTTP library) so that
the client's own CPU stays small beside the gateway it measures on a 2-core machine; its CPU
time is reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit


@dataclass
class _Response:
    status: int
    body: bytes
    first_content_at: float | None = None  # perf_counter() when the first content arrived


class _Lost(ConnectionError):
    """The connection closed before one byte of the response came."""


class _Cut(ConnectionError):
    """The connection closed while the response was arriving."""


_CONTENT = b'"content":"'


@dataclass
class _Totals:
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    incomplete: int = 0  # a 200 without its final chunk / data
    reconnects: int = 0
    lost: int = 0  # connection closed before any byte of the response
    cut: int = 0  # connection closed mid-response
    latencies_ns: list[int] = field(default_factory=list)
    ttft_ns: list[int] = field(default_factory=list)  # streams: send to first content
    last_finish: float = 0.0
    events: int = 0  # streams: data lines of every complete response
    window_streams: int = 0  # complete 200s that finished inside the window
    window_events: int = 0  # their data lines


class _Connection(asyncio.Protocol):
    """One keep-alive connection: one request at a time, the response parsed as it arrives."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[_Response] | None = None
        self._closed = False
        self._reset_response()

    def _reset_response(self) -> None:
        self._status = 0
        self._length: int | None = None  # Content-Length, or None for chunked
        self._head_done = False
        self._pos = 0  # parse position in the buffer (chunked bodies)
        self._chunks: list[bytes] = []
        self._received = False  # any byte of the response
        self._first_content_at: float | None = None
        self._scanned = 0  # how far the buffer was searched for the first content

    @property
    def closed(self) -> bool:
        return self._closed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though uvloop's do not subclass asyncio.Transport.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._waiter is not None and not self._waiter.done():
            if self._received:
                self._waiter.set_exception(_Cut("connection closed mid-response"))
            else:
                self._waiter.set_exception(_Lost("connection closed before the response"))

    def send(self, request: bytes) -> asyncio.Future[_Response]:
        assert self._transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return self._waiter

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._received = True
        if not self._head_done and not self._parse_head():
            return
        if self._length is None and self._first_content_at is None:
            self._find_first_content()
        body = self._parse_length_body() if self._length is not None else self._parse_chunks()
        if body is None:
            return
        waiter, self._waiter = self._waiter, None
        status, first_content_at = self._status, self._first_content_at
        self._reset_response()
        if waiter is not None and not waiter.done():
            waiter.set_result(_Response(status, body, first_content_at))

    def _find_first_content(self) -> None:
        buffer = self._buffer
        at = buffer.find(_CONTENT, max(self._scanned - len(_CONTENT), 0))
        while at >= 0:
            after = at + len(_CONTENT)
            if after >= len(buffer):
                break  # its first character has not come yet
            if buffer[after] != 0x22:  # not an empty string: text
                self._first_content_at = time.perf_counter()
                return
            at = buffer.find(_CONTENT, after)
        self._scanned = len(buffer)

    def _parse_head(self) -> bool:
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self._buffer[:end]).split(b"\r\n")
        del self._buffer[: end + 4]
        self._status = int(lines[0].split(b" ", 2)[1])
        self._length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                self._length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                self._length = None
        self._head_done = True
        return True

    def _parse_length_body(self) -> bytes | None:
        assert self._length is not None
        if len(self._buffer) < self._length:
            return None
        body = bytes(self._buffer[: self._length])
        del self._buffer[: self._length]
        return body

    def _parse_chunks(self) -> bytes | None:
        buffer = self._buffer
        while True:
            line_end = buffer.find(b"\r\n", self._pos)
            if line_end < 0:
                return None
            size = int(bytes(buffer[self._pos : line_end]).split(b";", 1)[0], 16)
            start = line_end + 2
            if len(buffer) < start + size + 2:
                return None
            if size == 0:  # the last chunk; no trailers expected
                del buffer[: start + 2]
                self._pos = 0
                return b"".join(self._chunks)
            self._chunks.append(bytes(buffer[start : start + size]))
            self._pos = start + size + 2


def _request_bytes(
    url: str,
    model: str,
    stream: bool,
    api_key: str | None,
    extra: list[str],
    max_tokens: int = 32,
) -> bytes:
    parts = urlsplit(url)
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello in a few words."}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    payload = json.dumps(body, separators=(",", ":")).encode()
    headers = [
        f"POST {parts.path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(payload)}",
        "Connection: keep-alive",
    ]
    if api_key:
        headers.append(f"Authorization: Bearer {api_key}")
    headers += extra
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + payload


def _complete(response: _Response, stream: bool) -> bool:
    if stream:
        return response.body.rstrip().endswith(b"data: [DONE]")
    return b'"choices"' in response.body


async def _connect(host: str, port: int) -> _Connection:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(_Connection, host, port)
    return protocol


async def _run(args: argparse.Namespace) -> dict[str, object]:
    parts = urlsplit(args.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = _request_bytes(
        args.url, args.model, args.stream, args.api_key, args.header, args.max_tokens
    )
    connections = [await _connect(host, port) for _ in range(args.concurrency)]
    totals = _Totals()
    started = time.perf_counter()
    measure_from = started + args.warmup
    stop_at = measure_from + args.seconds
    cpu: dict[str, float] = {}

    async def worker(index: int) -> None:
        conn = connections[index]
        if args.ramp:  # the workers start one after another over the ramp, not at once
            await asyncio.sleep(args.ramp * index / args.concurrency)
        while True:
            sent_at = time.perf_counter()
            if sent_at >= stop_at or (args.requests and totals.sent >= args.requests):
                return
            if conn.closed:
                totals.reconnects += 1
                conn = connections[index] = await _connect(host, port)
            if "start" not in cpu and sent_at >= measure_from:
                cpu["start"] = time.process_time()
            totals.sent += 1
            try:
                response = await conn.send(request)
            except ConnectionError as error:
                totals.statuses[0] += 1
                if isinstance(error, _Lost):
                    totals.lost += 1
                elif isinstance(error, _Cut):
                    totals.cut += 1
                continue
            finished = time.perf_counter()
            totals.statuses[response.status] += 1
            complete = response.status == 200 and _complete(response, args.stream)
            if response.status == 200 and not complete:
                totals.incomplete += 1
            events = response.body.count(b"data: ") if complete and args.stream else 0
            totals.events += events
            if complete and measure_from <= finished < stop_at:
                totals.window_streams += 1
                totals.window_events += events
            if sent_at >= measure_from:
                totals.latencies_ns.append(int((finished - sent_at) * 1e9))
                totals.last_finish = max(totals.last_finish, finished)
                if response.first_content_at is not None:
                    totals.ttft_ns.append(int((response.first_content_at - sent_at) * 1e9))

    await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
    cpu_s = time.process_time() - cpu.get("start", time.process_time())
    for conn in connections:
        conn.close()
    return _summary(args, totals, measure_from, cpu_s)


def _percentile(ordered: list[int], q: float) -> float:
    """Nearest-rank percentile of sorted nanoseconds, in milliseconds."""
    if not ordered:
        return 0.0
    rank = max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))
    return ordered[rank] / 1e6


def _summary(
    args: argparse.Namespace, totals: _Totals, measure_from: float, cpu_s: float
) -> dict[str, object]:
    ordered = sorted(totals.latencies_ns)
    ttft = sorted(totals.ttft_ns)
    window = max(totals.last_finish - measure_from, 1e-9)
    measured = len(ordered)
    return {
        "concurrency": args.concurrency,
        "stream": args.stream,
        "sent": totals.sent,
        "statuses": {str(k): v for k, v in sorted(totals.statuses.items())},
        "ok": totals.statuses.get(200, 0) == totals.sent and totals.incomplete == 0,
        "incomplete": totals.incomplete,
        "reconnects": totals.reconnects,
        "lost": totals.lost,
        "cut": totals.cut,
        "events": totals.events,
        "window_streams_per_s": round(totals.window_streams / args.seconds, 1),
        "window_events_per_s": round(totals.window_events / args.seconds, 1),
        "ttft_p50_ms": round(_percentile(ttft, 0.50), 3),
        "ttft_p99_ms": round(_percentile(ttft, 0.99), 3),
        "measured": measured,
        "window_s": round(window, 3),
        "rps": round(measured / window, 1),
        "p50_ms": round(_percentile(ordered, 0.50), 3),
        "p90_ms": round(_percentile(ordered, 0.90), 3),
        "p99_ms": round(_percentile(ordered, 0.99), 3),
        "max_ms": round(ordered[-1] / 1e6, 3) if ordered else 0.0,
        "client_cpu_ms_per_request": round(cpu_s * 1000 / max(measured, 1), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the chat completions URL")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument(
        "--header", action="append", default=[], help="'NAME: VALUE', sent with every request"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--ramp", type=float, default=0.0, help="seconds over which the workers start"
    )
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument(
        "--requests", type=int, default=0, help="stop sending after this many (0: no limit)"
    )
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        run = asyncio.run
    else:
        # The client's reads in C: at 1,000 streams, asyncio's own loop spent more of the
        # machine than the gateway can spare (bench/README.md, "Load generator").
        run = uvloop.run
    print(json.dumps(run(_run(args))), flush=True)


if __name__ == "__main__":
    main()
