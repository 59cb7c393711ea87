"""What every driver shares: the request and binding it is given, what it returns, how it
fails, and the HTTP edge (one pooled :class:`~router.drivers.http.HTTPClient`, per-attempt
timeouts, byte limits).

A driver translates a chat request to its provider's API and the answer back to OpenAI
shapes, and classifies failures with :func:`router.request.classify.classify`. It never decides a
retry or a failover (contract §5: "only the core decides failover; a driver only classifies").
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Final, Literal, Self

import orjson

from ledger.events import Usage
from router.config import Endpoint
from router.config import Proxy as ProxySetting
from router.drivers.http import (
    ConnectFailed,
    Headers,
    HTTPClient,
    HTTPError,
    PreparedRequest,
    Proxy,
    ReadTimeout,
    Response,
    TunnelFailed,
    prepare_request,
)
from router.drivers.sse import EndReason, SSEError, SSEStream
from router.request.classify import Classification, Transport, UpstreamOutcome, classify

__all__ = [
    "ATTEMPT_ID_HEADER",
    "AttemptBinding",
    "AttemptTimeouts",
    "ChatRequest",
    "Driver",
    "DriverResult",
    "DriverStream",
    "NativeBody",
    "PreparedCall",
    "SSEDriverStream",
    "StreamErrorEvent",
    "StreamTranslator",
    "UpstreamFailure",
    "count_bytes",
    "elapsed_ms",
    "optional_str",
    "proxy_of",
    "retry_after_ms",
    "sanitize",
]

ATTEMPT_ID_HEADER: Final = "X-Waybill-Attempt-Id"
# Idle upstream connections kept per origin. Many long streams at once end and begin in
# numbers, and on a busy gateway a new stream asks for its connection well after others
# were let go: a pool of 32 had closed most of them, and streams at c1000 kept opening
# connections of their own (bench/README.md, "Decisions").
_MAX_IDLE: Final = 1024
_MAX_ERROR_BODY: Final = 64 * 1024
_MAX_MESSAGE_CHARS: Final = 300


@dataclass(frozen=True, slots=True)
class NativeBody:
    """The client's body in an upstream dialect's own shape, as a door received it (the
    Anthropic door's Messages body): a driver of that dialect sends it as it came — the
    mapping's upstream model, the resolved output bound and ``stream`` set — with
    ``headers`` (e.g. ``anthropic-beta``), rather than translating the canonical body."""

    dialect: str  # a driver's `dialect` ("anthropic")
    body: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChatRequest:
    """The client's OpenAI-style body, and what the core resolved for this attempt;
    ``native`` the same request in the dialect it arrived in, if a door kept it.

    ``kind`` is the request's (contract §2, a model group's ``kind``): a ``chat`` body is a
    chat completion's, an ``embeddings`` body OpenAI's embeddings request (``input``,
    ``dimensions``, ``encoding_format``, ``user``), sent to the dialect's embeddings API and
    answered in OpenAI's embeddings shape, buffered."""

    body: Mapping[str, Any]
    upstream_model: str
    max_tokens: int | None = None
    stream: bool = False
    native: NativeBody | None = None
    kind: Literal["chat", "embeddings"] = "chat"


@dataclass(frozen=True)
class AttemptTimeouts:
    attempt_timeout_s: float  # no response headers by then: timeout
    first_token_timeout_s: float | None = None  # stream: no first event by then
    stream_idle_timeout_s: float | None = None  # stream: silence between events


@dataclass(frozen=True)
class AttemptBinding:
    """One attempt bound to one endpoint; a config reload never changes it in flight."""

    endpoint: Endpoint
    upstream_model: str
    attempt_id: str
    timeouts: AttemptTimeouts
    traceparent: str | None = None
    tracestate: str | None = None  # the caller's, forwarded unchanged beside traceparent
    extra_headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PreparedCall:
    """One attempt's upstream request, built and ready to send (:meth:`Driver.prepare`):
    the gateway builds it while the attempt's start is being committed, and sends it once
    that commit is durable."""

    request: ChatRequest
    binding: AttemptBinding
    http: PreparedRequest


@dataclass(frozen=True)
class DriverResult:
    """A buffered completion in OpenAI ``chat.completion`` shape."""

    response: dict[str, Any]
    usage: Usage | None  # None: the upstream did not say; usage is unknown
    finish_reason: str | None
    upstream_request_id: str | None
    response_id: str | None
    status: int
    response_bytes: int = 0  # the body as read off the wire


class UpstreamFailure(Exception):
    """An attempt that failed, with the facts seen and what they mean.

    Its message holds the class, evidence, status and the provider's sanitized error text;
    never a key, a prompt or a completion.
    """

    def __init__(
        self,
        outcome: UpstreamOutcome,
        classification: Classification,
        *,
        events_yielded: bool = False,
        upstream_request_id: str | None = None,
        response_bytes: int = 0,
    ) -> None:
        self.outcome = outcome
        self.classification = classification
        self.events_yielded = events_yielded
        self.upstream_request_id = upstream_request_id
        self.response_bytes = response_bytes  # of the body, as far as it was read
        where = outcome.transport or f"HTTP {outcome.http_status}"
        detail = f": {outcome.error_message}" if outcome.error_message else ""
        super().__init__(
            f"{classification.failure_class} ({classification.evidence}, {where}){detail}"
        )

    @property
    def failure_class(self) -> str:
        return self.classification.failure_class


class DriverStream(ABC):
    """A streamed completion: iterate once for OpenAI ``chat.completion.chunk`` dicts, or
    once over :meth:`batches` for the same chunks a network read at a time.

    Iteration raises :class:`UpstreamFailure` on a failure, with ``events_yielded`` telling
    whether any chunk was already handed out. Use ``async with`` (or :meth:`aclose`) so the
    connection goes back to the pool or is dropped.
    """

    usage: Usage | None = None
    finish_reason: str | None = None
    response_id: str | None = None
    upstream_request_id: str | None = None
    time_to_first_chunk_ms: int | None = None
    raw: bytes | None = None
    """The batch just handed out as the upstream's bytes, when those are exactly its chunks
    as SSE ``data:`` frames (an OpenAI stream passed through); None when they are not (a
    translated stream, an event skipped or unusual framing in that read): then the chunks
    must be encoded. None again once the next batch is asked for."""

    @property
    @abstractmethod
    def invalid_events(self) -> int: ...

    @property
    def response_bytes(self) -> int:
        """The body's bytes read off the wire so far."""
        return 0

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        async for batch in self.batches():
            for chunk in batch:
                yield chunk

    @abstractmethod
    def batches(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The chunks in non-empty lists, each what one read of the body completed."""

    def tap(self, deliver: Callable[[list[dict[str, Any]], bytes], bool]) -> None:
        """While :meth:`batches` waits for its next read, hand each read that would pass
        through unchanged (:attr:`raw`) and does not end the stream to ``deliver`` as it
        arrives, with its chunks, inside the connection's callback, instead of waking the
        reader: a read ``deliver`` takes (True) is never handed out by :meth:`batches`. The
        first read it leaves (False), or that cannot be tapped, goes to :meth:`batches` as
        usual, and the tap is off until set again. ``deliver`` must not raise. A stream
        that cannot be tapped ignores this."""
        return None

    @property
    def ended(self) -> bool:
        """The provider has said its stream is over: the batch just handed out was the last
        (the next step of :meth:`batches` only checks the ending, without waiting)."""
        return False

    @abstractmethod
    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class Driver(ABC):
    """One provider API. Holds one pooled :class:`HTTPClient`; close it with :meth:`aclose`."""

    _request_id_header: ClassVar[str]
    dialect: ClassVar[str]  # the config's `driver:` name; a NativeBody of it is sent as it came
    # The provider's API takes no request without an output bound (Anthropic's max_tokens):
    # the core then sends the one it reserved for (router/request/worst_case.py).
    requires_max_tokens: ClassVar[bool] = False
    # The provider has an embeddings API (OpenAI's `/v1/embeddings`); config validation
    # keeps endpoints of a dialect without one out of embeddings groups.
    embeds: ClassVar[bool] = False

    def __init__(self, client: HTTPClient | None = None) -> None:
        self._client = client or HTTPClient(max_idle_per_origin=_MAX_IDLE, idle_expiry_s=30.0)

    async def aclose(self) -> None:
        await self._client.aclose()

    def prepare(self, request: ChatRequest, binding: AttemptBinding) -> PreparedCall:
        """The upstream request for ``request`` (``request.stream`` says which kind), ready
        for :meth:`complete` or :meth:`stream`. ``ValueError`` for a header that cannot be
        written (a CR or LF in it)."""
        headers = {**self._headers(binding), "content-type": "application/json"}
        native = request.native
        if native is not None and native.dialect == self.dialect:
            headers.update(native.headers)
        if request.kind == "embeddings":
            if not self.embeds:
                raise ValueError(f"the {self.dialect} dialect has no embeddings API")
            url, payload = self._embeddings_url(binding), self._embeddings_payload(request)
        else:
            url, payload = self._url(binding, request), self._payload(request)
        proxy = proxy_of(binding.endpoint.proxy)
        http = prepare_request(
            "POST", url, headers=headers, body=orjson.dumps(payload), proxy=proxy
        )
        return PreparedCall(request, binding, http)

    def _embeddings_url(self, binding: AttemptBinding) -> str:
        raise NotImplementedError  # only a dialect that `embeds` is asked

    def _embeddings_payload(self, request: ChatRequest) -> dict[str, Any]:
        raise NotImplementedError

    @abstractmethod
    async def complete(self, call: PreparedCall) -> DriverResult:
        """A buffered completion (or, for an ``embeddings`` request, the embeddings), or
        :class:`UpstreamFailure`."""

    @abstractmethod
    async def stream(self, call: PreparedCall) -> DriverStream:
        """Open a stream; a failure before the first event raises from iteration or here."""

    @abstractmethod
    def _url(self, binding: AttemptBinding, request: ChatRequest) -> str: ...

    @abstractmethod
    def _payload(self, request: ChatRequest) -> dict[str, Any]:
        """The provider's request body for ``request``."""

    # --- the HTTP edge, shared by the dialects ---

    @abstractmethod
    def _auth_headers(self, endpoint: Endpoint) -> dict[str, str]: ...

    def _error_outcome(
        self, status: int, body: Any, headers: Headers, secret: str | None
    ) -> UpstreamOutcome:
        # Both wire formats put the cause under "error" (OpenAI adds a "code"; Anthropic
        # has only a "type"), so one reading serves both.
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            error = {}
        return UpstreamOutcome(
            http_status=status,
            error_code=optional_str(error.get("code")),
            error_type=optional_str(error.get("type")),
            error_message=sanitize(error.get("message"), secret),
            error_param=sanitize(error.get("param"), secret),
            retry_after_ms=retry_after_ms(headers),
            execution_state_header=headers.get("x-execution-state"),
        )

    def _headers(self, binding: AttemptBinding) -> dict[str, str]:
        headers = {**binding.extra_headers, **self._auth_headers(binding.endpoint)}
        headers[ATTEMPT_ID_HEADER] = binding.attempt_id
        if binding.traceparent:
            headers["traceparent"] = binding.traceparent
            if binding.tracestate:
                headers["tracestate"] = binding.tracestate
        return headers

    async def _open(self, call: PreparedCall, *, stream: bool) -> Response:
        """Send the request and wait for the response headers within the attempt timeout."""
        if call.request.stream != stream:
            kind = "a streamed" if stream else "a buffered"
            raise ValueError(f"{kind} call needs a request prepared with stream={stream}")
        binding = call.binding
        timeouts = binding.timeouts
        # Every later wait for body bytes is bounded by this; a stream's idle timeout is
        # enforced on events by SSEStream, so the wire waits at least as long.
        read_timeout = timeouts.attempt_timeout_s
        if stream and timeouts.stream_idle_timeout_s is not None:
            read_timeout = max(read_timeout, timeouts.stream_idle_timeout_s)
        try:
            # Not an asyncio.timeout around the call: running out while connecting (or
            # opening a proxy's tunnel) must read as a connect error, nothing written.
            response = await self._client.send(
                call.http,
                connect_timeout=timeouts.attempt_timeout_s,
                read_timeout=read_timeout,
                headers_timeout=timeouts.attempt_timeout_s,
            )
        except (TimeoutError, ReadTimeout) as exc:
            raise self._transport_failure(binding, "timeout_before_headers") from exc
        except TunnelFailed as exc:  # the proxy's answer, never the upstream's
            raise self._transport_failure(binding, "connect_error", message=exc.detail) from exc
        except ConnectFailed as exc:  # the request was never written
            raise self._transport_failure(binding, "connect_error") from exc
        except HTTPError as exc:  # written, then reset or answered with garbage
            raise self._transport_failure(binding, "sent_then_reset") from exc
        if response.status_code >= 400:
            await self._raise_for_error(response, binding)
        return response

    async def _raise_for_error(self, response: Response, binding: AttemptBinding) -> None:
        request_id = response.headers.get(self._request_id_header)
        raw = b""
        try:
            async for piece in response.aiter_bytes():
                raw += piece
                if len(raw) > _MAX_ERROR_BODY:
                    break
        except HTTPError:
            pass  # the status alone classifies; a cut error body changes nothing
        finally:
            await response.aclose()
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        secret = _secret(binding.endpoint)
        outcome = self._error_outcome(response.status_code, body, response.headers, secret)
        raise UpstreamFailure(
            outcome,
            classify(outcome, trust_not_started=binding.endpoint.trust_not_started),
            upstream_request_id=request_id,
            response_bytes=len(raw),
        )

    def _transport_failure(
        self,
        binding: AttemptBinding,
        transport: Transport,
        *,
        status: int | None = None,
        events_yielded: bool = False,
        request_id: str | None = None,
        message: str | None = None,
        response_bytes: int = 0,
    ) -> UpstreamFailure:
        outcome = UpstreamOutcome(http_status=status, transport=transport, error_message=message)
        return UpstreamFailure(
            outcome,
            classify(outcome, trust_not_started=binding.endpoint.trust_not_started),
            events_yielded=events_yielded,
            upstream_request_id=request_id,
            response_bytes=response_bytes,
        )

    async def _read_body(self, response: Response, binding: AttemptBinding) -> tuple[Any, int]:
        """The whole JSON body of a 2xx, within ``max_response_bytes``, and its size."""
        limit = binding.endpoint.max_response_bytes
        request_id = response.headers.get(self._request_id_header)
        chunks: list[bytes] = []
        size = 0
        try:
            declared = int(response.headers.get("content-length", "0"))
            if declared > limit:
                raise self._too_large(binding, response.status_code, request_id, 0)
            async for piece in response.aiter_bytes():
                size += len(piece)
                if size > limit:
                    raise self._too_large(binding, response.status_code, request_id, size)
                chunks.append(piece)
        except HTTPError as exc:  # cut, stalled past the read timeout, or garbled
            raise self._transport_failure(
                binding,
                "broken_stream",
                status=response.status_code,
                request_id=request_id,
                response_bytes=size,
            ) from exc
        finally:
            await response.aclose()
        try:
            return orjson.loads(b"".join(chunks)), size
        except orjson.JSONDecodeError as exc:
            raise self._transport_failure(
                binding,
                "invalid_response",
                status=response.status_code,
                request_id=request_id,
                message="response body is not JSON",
                response_bytes=size,
            ) from exc

    def _too_large(
        self, binding: AttemptBinding, status: int, request_id: str | None, size: int
    ) -> UpstreamFailure:
        limit = binding.endpoint.max_response_bytes
        return self._transport_failure(
            binding,
            "response_too_large",
            status=status,
            request_id=request_id,
            message=f"response over max_response_bytes ({limit})",
            response_bytes=size,
        )


# --- helpers shared by the dialects ---


@functools.lru_cache(maxsize=64)
def proxy_of(setting: ProxySetting | None) -> Proxy | None:
    """The HTTP client's proxy for an endpoint's ``proxy`` setting."""
    # Cached: an endpoint's proxy is one object per config generation; one Proxy (and one
    # base64 of its credentials) per setting keeps its pool key a cheap, stable value.
    if setting is None:
        return None
    if setting.username is None:
        return Proxy(setting.host, setting.port)
    password = "" if setting.password is None else setting.password.get_secret_value()
    return Proxy.basic(setting.host, setting.port, setting.username.get_secret_value(), password)


def _secret(endpoint: Endpoint) -> str | None:
    return endpoint.api_key.get_secret_value() if endpoint.api_key is not None else None


def sanitize(message: object, secret: str | None) -> str | None:
    """A provider's error text, short and without the key (some echo part of it back)."""
    if not isinstance(message, str) or not message:
        return None
    if secret:
        message = message.replace(secret, "[redacted]")
    return message[:_MAX_MESSAGE_CHARS]


def retry_after_ms(headers: Headers) -> int | None:
    """``retry-after-ms`` if given, else ``Retry-After`` in seconds (an HTTP date is ignored)."""
    for name, scale in (("retry-after-ms", 1.0), ("retry-after", 1000.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        if math.isfinite(number) and number >= 0:
            return math.ceil(number * scale)
    return None


def count_bytes(
    source: AsyncIterator[bytes], limit: int, on_over: Exception
) -> AsyncIterator[bytes]:
    """Pass ``source`` through, raising ``on_over`` once more than ``limit`` bytes went by."""
    return _Counted(source, limit, on_over)


class _Counted:
    # An iterator object, not an async generator, like the body it counts: an SSE stream
    # leaves both unfinished at [DONE], and the event loop would close each in a task.
    __slots__ = ("_limit", "_on_over", "_source", "_total")

    def room(self) -> int:
        """How many more bytes may go by."""
        return self._limit - self._total

    @property
    def total(self) -> int:
        """How many bytes went by."""
        return self._total

    def took(self, size: int) -> None:
        """Count ``size`` bytes read around the iterator (by a tap), within :meth:`room`."""
        self._total += size

    def __init__(self, source: AsyncIterator[bytes], limit: int, on_over: Exception) -> None:
        self._source = source
        self._limit = limit
        self._on_over = on_over
        self._total = 0

    def __aiter__(self) -> _Counted:
        return self

    async def __anext__(self) -> bytes:
        piece = await anext(self._source)
        self._total += len(piece)
        if self._total > self._limit:
            raise self._on_over
        return piece


def elapsed_ms(since: float) -> int:
    return round((time.monotonic() - since) * 1000)


# --- streaming, shared by the dialects ---


class StreamErrorEvent(Exception):
    """An error the provider reported inside a 200 stream (an ``error`` event)."""

    def __init__(self, outcome: UpstreamOutcome) -> None:
        self.outcome = outcome
        super().__init__(outcome.error_type or "stream error event")


class StreamTranslator(ABC):
    """Turns one provider's stream events into OpenAI chunks, remembering the totals."""

    usage: Usage | None = None
    finish_reason: str | None = None
    response_id: str | None = None
    passthrough: ClassVar[bool] = False
    """Each event is its own chunk, unchanged (``translate(event) == [event]``): the
    upstream's bytes can be relayed as they came (:attr:`DriverStream.raw`)."""

    @abstractmethod
    def translate(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The chunks for one event (maybe none); raises :class:`StreamErrorEvent`."""


class _TooLarge(Exception):
    pass


class SSEDriverStream(DriverStream):
    """An upstream SSE body read through :class:`router.drivers.sse.SSEStream` and a translator."""

    def __init__(
        self,
        driver: Driver,
        response: Response,
        binding: AttemptBinding,
        translator: StreamTranslator,
        started_at: float,
    ) -> None:
        self._driver = driver
        self._response = response
        self._binding = binding
        self._translator = translator
        self._started_at = started_at
        self._sse: SSEStream | None = None
        self._body: _Counted | None = None
        self._deliver: Callable[[list[dict[str, Any]], bytes], bool] | None = None
        self._tappable = False  # past the first chunk, in a passthrough stream's loop
        self.upstream_request_id = response.headers.get(driver._request_id_header)

    @property
    def invalid_events(self) -> int:
        return self._sse.invalid_events if self._sse is not None else 0

    @property
    def response_bytes(self) -> int:
        return self._body.total if self._body is not None else 0

    @property
    def ended(self) -> bool:
        return self._sse is not None and self._sse.end_reason is EndReason.DONE

    async def aclose(self) -> None:
        await self._response.aclose()

    def tap(self, deliver: Callable[[list[dict[str, Any]], bytes], bool]) -> None:
        if self._tappable:
            self._deliver = deliver
            self._response.tap(self._tapped)

    def _tapped(self, piece: bytes) -> bool:
        """One piece of the body while tapped: taken if it is whole plain events without
        ``[DONE]`` or an error, within the byte limit, and ``deliver`` takes them."""
        sse, body, deliver = self._sse, self._body, self._deliver
        if sse is None or body is None or deliver is None:
            return False
        chunks = sse.plain(piece)
        if not chunks:
            return False
        translate = self._translator.translate
        try:
            for chunk in chunks:
                translate(chunk)  # a passthrough translator's notes bear a second reading
        except StreamErrorEvent:
            return False  # the reader raises it, after what came before it
        if len(piece) > body.room() or not deliver(chunks, piece):
            return False  # over the limit, the reader reads it and raises
        body.took(len(piece))
        sse.took(piece, chunks)
        self._sync()
        return True

    def _sync(self) -> None:
        t = self._translator
        self.usage, self.finish_reason, self.response_id = t.usage, t.finish_reason, t.response_id

    def _fail(self, transport: Transport, yielded: bool, message: str) -> UpstreamFailure:
        return self._driver._transport_failure(
            self._binding,
            transport,
            status=self._response.status_code,
            events_yielded=yielded,
            request_id=self.upstream_request_id,
            message=message,
            response_bytes=self.response_bytes,
        )

    async def batches(self) -> AsyncIterator[list[dict[str, Any]]]:
        timeouts = self._binding.timeouts
        idle = timeouts.stream_idle_timeout_s
        first = timeouts.first_token_timeout_s
        if idle is not None and first is not None:
            idle = max(idle, first)  # before the first event, only first_token_timeout rules
        limit = self._binding.endpoint.max_response_bytes
        response = self._response
        body = self._body = _Counted(response.aiter_bytes(), limit, _TooLarge())
        # Timeouts are the body's read timeout and deadline (one timer per connection, not
        # one per read, and none that fires while the bytes that would stop it wait unread
        # on a busy loop: router.drivers.http). Until the first chunk, the first-token
        # deadline (from the attempt's start) always comes before an idle timeout of at
        # least as long from the wait's start; then the idle timeout rules.
        if first is not None:
            since = time.monotonic() - self._started_at
            response.read_deadline = asyncio.get_running_loop().time() + first - since
        idle_rules = idle is not None and first is None
        if idle_rules:
            response.read_timeout = idle
        sse = self._sse = SSEStream(body)
        events = sse.batches()
        translator = self._translator
        translate, passthrough = translator.translate, translator.passthrough
        yielded = False
        try:
            while True:
                try:
                    batch = await anext(events)
                except StopAsyncIteration:
                    break
                chunks, error = _translated(batch, translate, passthrough)
                del batch
                self._sync()
                self.raw = sse.raw if passthrough and error is None else None
                if chunks:
                    if not yielded:
                        self.time_to_first_chunk_ms = elapsed_ms(self._started_at)
                        yielded = True
                        self._tappable = passthrough
                        response.read_deadline = None
                        # From here every silence is bounded by the idle limit itself, not
                        # by the larger first-token one.
                        after = timeouts.stream_idle_timeout_s
                        if after is not None:
                            response.read_timeout, idle_rules = after, True
                    yield chunks
                # The next read is what a stream waits for most of its life: the reader has
                # these chunks and their bytes, and nothing here holds them meanwhile.
                del chunks
                self.raw = None
                if error is not None:
                    raise error
        except StreamErrorEvent as exc:
            trust = self._binding.endpoint.trust_not_started
            raise UpstreamFailure(
                exc.outcome,
                classify(exc.outcome, trust_not_started=trust),
                events_yielded=yielded,
                upstream_request_id=self.upstream_request_id,
                response_bytes=self.response_bytes,
            ) from None
        except _TooLarge:
            raise self._fail("response_too_large", yielded, "over max_response_bytes") from None
        except ReadTimeout as exc:
            if exc.deadline:
                raise self._fail("first_token_timeout", yielded, "no first event in time") from exc
            if not idle_rules:  # the attempt's own bound on the wire, not the idle timeout
                raise self._fail("broken_stream", yielded, "connection broke mid-stream") from exc
            kind: Transport = "stream_stalled" if yielded else "first_token_timeout"
            raise self._fail(kind, yielded, "stream idle") from exc
        except SSEError as exc:
            raise self._fail("broken_stream", yielded, type(exc).__name__) from exc
        except HTTPError as exc:
            raise self._fail("broken_stream", yielded, "connection broke mid-stream") from exc
        finally:
            self._tappable, self._deliver = False, None
            self._sync()
            if sse.end_reason is EndReason.DONE:
                # Read to [DONE]: the body's end follows at once; keep the connection.
                self._response.release_after_end()
            else:
                await self._response.aclose()
        # contract §5: a clean end after a final chunk is complete even without [DONE]; a stream
        # that stops without a finish reason (or inside a frame) is broken, never a success.
        if self.finish_reason is None or sse.end_reason is EndReason.EOF_MID_FRAME:
            raise self._fail("broken_stream", yielded, "stream ended without a finish reason")


def _translated(
    batch: list[dict[str, Any]],
    translate: Callable[[dict[str, Any]], list[dict[str, Any]]],
    passthrough: bool,
) -> tuple[list[dict[str, Any]], StreamErrorEvent | None]:
    """The chunks of one read's events, and the error event that cut it short, if one did:
    what came before it in the read still goes out."""
    chunks: list[dict[str, Any]] = batch if passthrough else []
    for index, event in enumerate(batch):
        try:
            translated = translate(event)
        except StreamErrorEvent as error:
            return (chunks[:index] if passthrough else chunks), error
        if not passthrough:
            chunks += translated
    return chunks, None


def optional_str(value: object) -> str | None:
    return None if value is None else str(value)
