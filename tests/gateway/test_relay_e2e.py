"""What a client receives of a relayed stream: the upstream's own bytes, chunk for chunk,
except where the gateway must change them; and the ledger's record of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from openai import AsyncOpenAI

from ledger.store import EventStore
from router.drivers.sse import DONE_FRAME
from tests.gateway.harness import gateway_before


def _event(body: str) -> bytes:
    # Spaced JSON and \u escapes, as some providers write it and orjson never would: what
    # the client gets shows whether the gateway passed the bytes on or wrote them anew.
    head = '"id": "chatcmpl-v1", "object": "chat.completion.chunk", "created": 1, "model": "m"'
    return b"data: {" + head.encode() + b", " + body.encode() + b"}\n\n"


ROLE = _event('"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]')
CONTENT = [
    _event(f'"choices": [{{"index": 0, "delta": {{"content": "caf\\u00e9 {i} "}}}}]')
    for i in range(8)
]
FINISH = _event('"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]')
USAGE = _event('"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 8}')
TEXT = "".join(f"café {i} " for i in range(8))


class _Verbatim:
    """An upstream that answers every request with the stream above, each event its own
    write 10 ms apart, and the finish, usage and ``[DONE]`` in one last write."""

    async def __aenter__(self) -> _Verbatim:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.root_url = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.root_url}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n")
                writer.write(b"Content-Type: text/event-stream\r\n\r\n")
                for event in [ROLE, *CONTENT, FINISH + USAGE + DONE_FRAME]:
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.sleep(0.01)
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@asynccontextmanager
async def _gateway(database_url: str) -> AsyncIterator[tuple[str, str, EventStore]]:
    async with _Verbatim() as upstream, gateway_before(database_url, upstream) as gateway:
        yield gateway


async def _body(url: str, secret: str, **extra: Any) -> tuple[bytes, str]:
    request = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"Authorization": f"Bearer {secret}"}
    async with (
        httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http,
        http.stream("POST", "/v1/chat/completions", json={**request, **extra}) as answer,
    ):
        assert answer.status_code == 200
        return b"".join([piece async for piece in answer.aiter_bytes()]), answer.headers[
            "x-request-id"
        ]


async def test_a_streams_chunks_reach_the_client_as_the_upstreams_bytes(database_url):
    async with _gateway(database_url) as (url, secret, store):
        body, request_id = await _body(url, secret, stream_options={"include_usage": True})
        # The stream's first read and its first content are held until the stream is
        # committed; from there on every chunk goes out as it came, the end with [DONE].
        for event in CONTENT[1:]:
            assert event in body
        assert body.endswith(FINISH + USAGE + DONE_FRAME)
        events = await store.read_stream(f"request-{request_id}")
        finished = next(e.data for e in events if e.type == "AttemptFinished")
        assert (finished["status"], finished["finish_reason"]) == ("succeeded", "stop")
        assert finished["usage"]["output_tokens"] == 8
        assert events[-1].type == "RequestCompleted"

        client = AsyncOpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model="chat",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
        finally:
            await client.close()
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TEXT
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


async def test_the_usage_chunk_a_client_did_not_ask_for_is_dropped_the_rest_passed_on(
    database_url,
):
    async with _gateway(database_url) as (url, secret, store):
        body, request_id = await _body(url, secret)
        for event in CONTENT[1:]:
            assert event in body
        assert b'"usage": {' not in body and body.endswith(DONE_FRAME)
        assert b'"finish_reason":"stop"' in body  # the last read, written anew without it
        events = await store.read_stream(f"request-{request_id}")
        finished = next(e.data for e in events if e.type == "AttemptFinished")
        assert finished["usage"]["output_tokens"] == 8  # asked for on the books' account
