"""Overload: beyond its capacity the gateway answers at once with 503 capacity_error and
Retry-After; the streams it accepted are never cut; and the ledger holds, of every request,
what its client got."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from router.drivers.sse import DONE_FRAME
from tests.gateway.harness import gateway_before

CAPACITY = 8
HANG_UPS = 2  # of the accepted streams, the clients that leave mid-stream


def _chunk(delta: str, finish: str = "null") -> bytes:
    return (
        b'data: {"id":"chatcmpl-g","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":%s,"finish_reason":%s}]}\n\n'
        % (delta.encode(), finish.encode())
    )


USAGE = (
    b'data: {"id":"chatcmpl-g","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":6}}\n\n'
)


class _Gated:
    """A provider whose streams send their first words, then wait until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.streams = 0

    async def __aenter__(self) -> _Gated:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.root_url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.root_url}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        words = ['{"content":"one "}', '{"content":"two "}', '{"content":"three"}']
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.streams += 1
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                before = [_chunk('{"role":"assistant","content":""}'), _chunk(words[0])]
                after = [_chunk(w) for w in words[1:]]
                for event in before:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await self.release.wait()
                for event in [*after, _chunk("{}", '"stop"') + USAGE + DONE_FRAME]:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@dataclass
class _Got:
    """What one client got."""

    request_id: str
    status: int
    body: bytes = b""
    left: bool = False  # the client hung up mid-stream

    @property
    def whole(self) -> bool:
        return self.body.endswith(DONE_FRAME) and b'"finish_reason":"stop"' in self.body


BODY = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_beyond_capacity_503_at_once_accepted_streams_whole_and_the_ledger_agrees(
    database_url,
):
    async with (
        _Gated() as upstream,
        gateway_before(database_url, upstream, max_in_flight=CAPACITY) as (url, secret, store),
        httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {secret}"},
            timeout=60,
            limits=httpx.Limits(max_connections=100),
        ) as http,
    ):
        started = asyncio.Queue[None]()
        leave = asyncio.Event()

        async def accepted(leaves: bool) -> _Got:
            async with http.stream("POST", "/v1/chat/completions", json=BODY) as answer:
                got = _Got(answer.headers["x-request-id"], answer.status_code)
                async for piece in answer.aiter_bytes():
                    got.body += piece
                    if b'"one "' in got.body and not got.left:
                        started.put_nowait(None)  # committed, its first words arrived
                        got.left = leaves
                        if leaves:
                            await leave.wait()
                            return got  # hang up: the connection is closed mid-stream
            return got

        streams = [asyncio.create_task(accepted(i < HANG_UPS)) for i in range(CAPACITY)]
        for _ in range(CAPACITY):
            await started.get()

        # The gateway is full and nothing it holds can end: every further request is
        # refused now, buffered or streamed, fresh or on a kept-alive connection.
        async def refused(stream: bool) -> _Got:
            answer = await http.post("/v1/chat/completions", json={**BODY, "stream": stream})
            got = _Got(answer.headers["x-request-id"], answer.status_code, answer.content)
            assert answer.headers["retry-after"] == "1"
            assert answer.json()["error"]["code"] == "capacity_error"
            return got

        excess = await asyncio.gather(*(refused(i % 2 == 0) for i in range(60)))
        excess += [await refused(True) for _ in range(10)]
        assert all(not s.done() for s in streams) and upstream.streams == CAPACITY
        leave.set()
        for hang_up in streams[:HANG_UPS]:
            await hang_up
        upstream.release.set()
        got = [await s for s in streams]
        after = await http.post("/v1/chat/completions", json=BODY)  # capacity is free again
        assert after.status_code == 200 and after.content.endswith(DONE_FRAME)

        assert {g.status for g in got} == {200} and {g.status for g in excess} == {503}
        assert [g.whole for g in got if not g.left] == [True] * (CAPACITY - HANG_UPS)
        assert not any(g.whole for g in got if g.left)

        async def recorded(request_id: str) -> tuple[str, ...]:
            for _ in range(500):  # a hang-up's end is recorded in the background
                events = await store.read_stream(f"request-{request_id}")
                if not events or events[-1].type in ("RequestCompleted", "RequestFailed"):
                    return tuple(e.type for e in events)
                await asyncio.sleep(0.02)
            raise AssertionError(f"request {request_id} never ended on the ledger")

        for g in got:
            types = await recorded(g.request_id)
            if g.whole:
                assert types[-1] == "RequestCompleted"
            else:
                assert types[-1] == "RequestFailed"
                failed = (await store.read_stream(f"request-{g.request_id}"))[-1].data
                assert (failed["error_code"], failed["stream_started"]) == (
                    "client_canceled",
                    True,
                )
        for g in excess:  # refused before anything was recorded or sent upstream
            assert await recorded(g.request_id) == ()
