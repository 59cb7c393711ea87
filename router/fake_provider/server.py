"""FakeUpstream: a fault-injecting LLM provider served over real HTTP on 127.0.0.1.

Each inference request takes the next Behavior from the plan (FIFO), or the default when the
plan is empty. A request that continues a partial assistant message in a form the fake's
`continuation` rule does not take is refused (400 `invalid_prefill`) before it takes one. The
server records every request and counts hits and connections; tests read those from their own
thread, so every piece of shared state sits behind one lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import ssl
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Self

from router.fake_provider._anthropic import ANTHROPIC
from router.fake_provider._continuation import Continuation, Partial, parse_continuation, refusal
from router.fake_provider._embeddings import EmbeddingsDialect
from router.fake_provider._http import BadRequest, Connection, Headers, HttpRequest
from router.fake_provider._openai import OPENAI
from router.fake_provider._reply import Dialect, Reply, prompt_tokens
from router.fake_provider._respond import Exchange, respond, send_json
from router.fake_provider._serving import Served
from router.fake_provider.behavior import Behavior

__all__ = ["FakeUpstream", "RecordedRequest"]

_INFERENCE: dict[str, Dialect] = {"/v1/chat/completions": OPENAI, "/v1/messages": ANTHROPIC}
_EMBEDDINGS: Final = "/v1/embeddings"  # its dialect holds the request's inputs: one each


@dataclass(frozen=True)
class Billed:
    """One answer the fake billed (every answer it began: a cut stream is billed whole, as a
    provider may): what its admin API reports as usage (``FakeAdminApi(billed_by=...)``)."""

    at: datetime
    dialect: str  # openai | anthropic
    model: str
    input_tokens: int  # cached included
    cached_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the fake received it. `behavior` is set for inference requests the
    fake answered from its plan.

    A request ending with a partial assistant message records its form (`continuation`:
    assistant_prefill, prefix_flag or continue_final_message) and the length of the partial
    text in characters (`continuation_chars`); `continuation_refused` when the fake answered
    it 400 `invalid_prefill` (it then took nothing from the plan: `behavior` is None).
    """

    method: str
    path: str
    query: str
    headers: Headers
    body: bytes
    json: Any
    connection_id: int
    request_id: str
    behavior: Behavior | None
    continuation: str | None = None
    continuation_chars: int | None = None
    continuation_refused: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "path": self.path,
            "query": self.query,
            "headers": dict(self.headers),
            "json": self.json,
            "connection_id": self.connection_id,
            "request_id": self.request_id,
            "behavior": self.behavior.to_json() if self.behavior else None,
            "continuation": self.continuation,
            "continuation_chars": self.continuation_chars,
            "continuation_refused": self.continuation_refused,
        }


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


class FakeUpstream(Served):
    """A fake OpenAI / Anthropic provider with a programmable plan of behaviors.

    Sync use runs the server on its own loop in a background thread::

        with FakeUpstream("east", plan=[Behavior.rate_limited(retry_after=1)]) as up:
            client = openai.OpenAI(base_url=up.base_url, api_key="x")

    Async use runs it on the caller's loop: ``async with FakeUpstream() as up: ...``.

    `continuation` is the form in which the fake continues a partial assistant message on
    the OpenAI wire (`assistant_prefill`, `prefix_flag`, `continue_final_message`), or
    `none`; like the models, it belongs to the provider: `reset()` leaves it.
    """

    def __init__(
        self,
        name: str = "fake",
        plan: Iterable[Behavior] = (),
        default: Behavior | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        models: Sequence[str] = ("fake-model",),
        tls: ssl.SSLContext | None = None,
        continuation: Continuation = "none",
    ) -> None:
        self.name = name
        self.host = host
        self._tls = tls  # a server context: serve https instead of http
        self._requested_port = port
        self._models = tuple(models)
        # One re-entrant lock guards all state shared with the test thread; predicates
        # passed to wait_for() read properties that take it again.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._plan: deque[Behavior] = deque(plan)
        self._default = default or Behavior.ok()
        self._continuation = parse_continuation(continuation)
        self._hits = 0
        self._hits_by_path: Counter[str] = Counter()
        self._requests: list[RecordedRequest] = []
        self._billed: list[Billed] = []
        self._body_sent: dict[str, int] = {}
        self._connections = 0
        self._client_gone = 0
        self._sequence = 0
        self._server: asyncio.Server | None = None
        self._port = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # Addresses

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("FakeUpstream is not running")
        return self._port

    @property
    def root_url(self) -> str:
        """Scheme, host and port: the base URL for the Anthropic SDK."""
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL, ending in /v1."""
        return f"{self.root_url}/v1"

    # Programming the plan

    def set_plan(self, plan: Iterable[Behavior]) -> None:
        with self._lock:
            self._plan = deque(plan)

    def set_default(self, behavior: Behavior) -> None:
        with self._lock:
            self._default = behavior

    def set_continuation(self, continuation: Continuation) -> None:
        """The form of partial assistant message the fake continues from now on."""
        rule = parse_continuation(continuation)
        with self._lock:
            self._continuation = rule

    def reset(self) -> None:
        """Empty plan, default back to ok, counters and request log cleared."""
        with self._lock:
            self._plan.clear()
            self._default = Behavior.ok()
            self._hits = self._connections = self._client_gone = self._sequence = 0
            self._hits_by_path.clear()
            self._requests.clear()
            self._body_sent.clear()
            self._notify()

    def _next_behavior(self) -> Behavior:
        with self._lock:
            return self._plan.popleft() if self._plan else self._default

    # What happened

    @property
    def plan(self) -> tuple[Behavior, ...]:
        with self._lock:
            return tuple(self._plan)

    @property
    def default(self) -> Behavior:
        with self._lock:
            return self._default

    @property
    def continuation(self) -> Continuation:
        with self._lock:
            return self._continuation

    @property
    def billed(self) -> list[Billed]:
        with self._lock:
            return list(self._billed)

    def _bill(self, dialect: str, reply: Reply) -> None:
        billed = Billed(
            datetime.now(UTC),
            dialect,
            reply.model,
            reply.prompt_tokens,
            reply.cached_tokens,
            reply.completion_tokens,
        )
        with self._lock:
            self._billed.append(billed)

    @property
    def hits(self) -> int:
        """Inference requests received (chat completions and messages)."""
        with self._lock:
            return self._hits

    @property
    def hits_by_path(self) -> dict[str, int]:
        with self._lock:
            return dict(self._hits_by_path)

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def body_sent(self, request_id: str) -> int | None:
        """The body bytes written in answer to a request (its id is the fake's request id
        header), once the answer is over; None before."""
        with self._lock:
            return self._body_sent.get(request_id)

    @property
    def connections(self) -> int:
        """TCP connections accepted; stays at 1 while a client reuses a pooled connection."""
        with self._lock:
            return self._connections

    @property
    def client_gone(self) -> int:
        """Responses the client abandoned before the fake finished them (stalls included)."""
        with self._lock:
            return self._client_gone

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "name": self.name,
                "hits": self._hits,
                "hits_by_path": dict(self._hits_by_path),
                "connections": self._connections,
                "client_gone": self._client_gone,
                "plan_remaining": len(self._plan),
                "default": self._default.to_json(),
                "continuation": self._continuation,
            }

    def wait_for(self, predicate: Callable[[FakeUpstream], bool], timeout: float = 5.0) -> None:
        """Block until `predicate(self)` holds; TimeoutError otherwise. Sync mode only."""
        if self._thread is None:
            # In async mode the server shares the caller's loop: blocking would deadlock it.
            raise RuntimeError("FakeUpstream is not running in sync mode; use wait_for_async")
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self), timeout):
                raise TimeoutError(f"fake upstream {self.name!r}: condition not met")

    async def wait_for_async(
        self, predicate: Callable[[FakeUpstream], bool], *, within: float = 5.0
    ) -> None:
        """Await until `predicate(self)` holds, for at most `within` seconds; TimeoutError
        otherwise. Works in both modes."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._async_waiters.append(entry)
        try:
            async with asyncio.timeout(within):
                while True:
                    entry[1].clear()
                    if predicate(self):
                        return
                    await entry[1].wait()
        except TimeoutError:
            raise TimeoutError(f"fake upstream {self.name!r}: condition not met") from None
        finally:
            with self._lock:
                self._async_waiters.remove(entry)

    def _notify(self) -> None:
        # Called with the lock held.
        self._changed.notify_all()
        for loop, event in self._async_waiters:
            with contextlib.suppress(RuntimeError):  # that waiter's loop is closed
                loop.call_soon_threadsafe(event.set)

    def _record(
        self,
        request: HttpRequest,
        connection_id: int,
        behavior: Behavior | None,
        partial: Partial | None = None,
        *,
        refused: bool = False,
    ) -> str:
        with self._lock:
            self._sequence += 1
            request_id = f"req_{self.name}_{self._sequence:06d}"
            self._hits_by_path[request.path] += 1
            inference = request.path in _INFERENCE or request.path == _EMBEDDINGS
            if request.method == "POST" and inference:
                self._hits += 1
            self._requests.append(
                RecordedRequest(
                    request.method,
                    request.path,
                    request.query,
                    request.headers,
                    request.body,
                    _parse_json(request.body),
                    connection_id,
                    request_id,
                    behavior,
                    continuation=partial.form if partial else None,
                    continuation_chars=len(partial.text) if partial else None,
                    continuation_refused=refused,
                )
            )
            self._notify()
            return request_id

    def _count_client_gone(self) -> None:
        with self._lock:
            self._client_gone += 1
            self._notify()

    # Lifecycle: async

    async def astart(self) -> Self:
        self._server = await asyncio.start_server(
            self._serve_connection,
            self.host,
            self._requested_port,
            reuse_address=True,
            ssl=self._tls,
        )
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def aclose(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    def thread_name(self) -> str:
        return f"fake-upstream-{self.name}"

    # Serving

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        with self._lock:
            self._connections += 1
            connection_id = self._connections
            self._notify()
        conn = Connection(reader, writer)
        try:
            while not conn.closed:
                try:
                    request = await conn.read_request()
                except BadRequest as exc:
                    await send_json(conn, 400, {"error": {"message": str(exc)}}, keep_alive=False)
                    break
                if request is None:
                    break
                await self._handle(conn, request, connection_id)
                if not request.keep_alive:
                    break
        except ConnectionError:
            # A write failed: the client left in the middle of a response.
            self._count_client_gone()
        except asyncio.CancelledError:
            # Only aclose() cancels connection tasks. Ending quietly is deliberate: on
            # Python 3.11 asyncio.streams logs a cancelled client_connected_cb task as an
            # unhandled error.
            pass
        finally:
            if not conn.closed:
                conn.closed = True
                writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def _handle(self, conn: Connection, request: HttpRequest, connection_id: int) -> None:
        if request.path.startswith("/_fake/"):
            await self._control(conn, request)
            return
        dialect = _INFERENCE.get(request.path)
        if request.path == _EMBEDDINGS and request.method == "POST":
            body = _parse_json(request.body)
            dialect = EmbeddingsDialect(body if isinstance(body, dict) else {})
        if dialect is not None and request.method == "POST":
            await self._inference(conn, request, dialect, connection_id)
            return
        request_id = self._record(request, connection_id, None)
        headers = {"x-request-id": request_id, "x-fake-upstream": self.name}
        keep_alive = request.keep_alive
        if request.path == "/v1/messages/count_tokens" and request.method == "POST":
            # Anthropic's token counting: free, and never an inference (nothing of the plan).
            body = _parse_json(request.body)
            if not isinstance(body, dict):
                error = ANTHROPIC.bad_request("The request body is not a JSON object.", request_id)
                await send_json(conn, 400, error.body, keep_alive=keep_alive, headers=headers)
                return
            counted = {"input_tokens": prompt_tokens(body)[0]}
            await send_json(conn, 200, counted, keep_alive=keep_alive, headers=headers)
            return
        if request.path == "/v1/models" and request.method == "GET":
            models = [
                {"id": m, "object": "model", "created": 0, "owned_by": self.name}
                for m in self._models
            ]
            body = {"object": "list", "data": models}
            await send_json(conn, 200, body, keep_alive=keep_alive, headers=headers)
            return
        url = f"{request.method} {request.path}"
        error = OPENAI.bad_request(f"Unknown request URL: {url}", "", code="unknown_url")
        await send_json(conn, 404, error.body, keep_alive=keep_alive, headers=headers)

    async def _control(self, conn: Connection, request: HttpRequest) -> None:
        """The HTTP control API, for tests in another process."""
        body = _parse_json(request.body)
        route = (request.method, request.path)
        keep_alive = request.keep_alive
        try:
            if route == ("POST", "/_fake/plan"):
                if not isinstance(body, list):
                    raise ValueError("the plan is a JSON list of behaviors")
                self.set_plan([Behavior.from_json(item) for item in body])
            elif route == ("POST", "/_fake/default"):
                self.set_default(Behavior.from_json(body))
            elif route == ("POST", "/_fake/continuation"):
                if not isinstance(body, dict) or set(body) != {"continuation"}:
                    raise ValueError('the continuation is {"continuation": RULE}')
                self.set_continuation(parse_continuation(body["continuation"]))
            elif route == ("POST", "/_fake/reset"):
                self.reset()
            elif route == ("GET", "/_fake/requests"):
                data = [r.to_json() for r in self.requests]
                await send_json(conn, 200, {"data": data}, keep_alive=keep_alive)
                return
            elif route != ("GET", "/_fake/stats"):
                await send_json(
                    conn, 404, {"error": "unknown control route"}, keep_alive=keep_alive
                )
                return
        except ValueError as exc:
            await send_json(conn, 400, {"error": str(exc)}, keep_alive=keep_alive)
            return
        await send_json(conn, 200, self.stats(), keep_alive=keep_alive)

    async def _inference(
        self, conn: Connection, request: HttpRequest, dialect: Dialect, connection_id: int
    ) -> None:
        body = _parse_json(request.body)
        if not isinstance(body, dict):
            request_id = self._record(request, connection_id, None)
            error = dialect.bad_request("The request body is not a JSON object.", request_id)
            headers = {dialect.request_id_header: request_id, "x-fake-upstream": self.name}
            await send_json(conn, 400, error.body, keep_alive=request.keep_alive, headers=headers)
            return
        partial = dialect.partial(body)
        native = dialect.continues_natively
        refused = None if partial is None else refusal(partial, self.continuation, native=native)
        if refused is not None:
            # A provider's validation error: it takes nothing from the plan.
            request_id = self._record(request, connection_id, None, partial, refused=True)
            error = dialect.bad_request(refused, request_id, code="invalid_prefill")
            headers = {dialect.request_id_header: request_id, "x-fake-upstream": self.name}
            await send_json(conn, 400, error.body, keep_alive=request.keep_alive, headers=headers)
            return
        behavior = self._next_behavior()
        # Recorded before answering, so a test can wait for a request that then stalls.
        request_id = self._record(request, connection_id, behavior, partial)
        exchange = Exchange(
            conn=conn,
            request=request,
            dialect=dialect,
            prompt=dialect.parse(body),
            behavior=behavior,
            upstream=self.name,
            request_id=request_id,
            on_client_gone=self._count_client_gone,
            partial=partial.text if partial else None,
            on_reply=functools.partial(self._bill, dialect.name),
        )
        try:
            await respond(exchange)
        finally:
            with self._lock:
                self._body_sent[request_id] = conn.body_sent
                self._notify()
