"""The stream relay (contract §5 "Streaming", "Resume"): what commits a stream, and the
committed stream's bytes to the client, continued across a resume.

A stream is held until its first chunk with content (:func:`first_content`); until then a
failure can still fail over unseen. Once committed, a read's chunks go out together, as the
upstream's bytes where nothing in them is to change (``DriverStream.raw``), else encoded
again; reads that pass through unchanged may go straight from the upstream connection's
callback to the client's (:meth:`StreamRelay.deliver`, ``DriverStream.tap``). The relay
keeps what the client has — the text of the stream, for a resume; its id and model — and
rewrites a resume's continuation to follow on as the same stream
(:class:`router.request.resume.Seam`), its final usage counting the broken attempts' output
too (:func:`router.request.resume.resumed_usage`).

The chunks are the drivers' canonical OpenAI ``chat.completion.chunk`` dicts, sent as SSE.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, Final, Protocol

from ledger import events as ev
from ledger.store import LedgerUnavailable
from router.drivers import DriverStream, UpstreamFailure
from router.drivers.sse import DONE_FRAME, encode_json
from router.errors import GatewayError, ledger_unavailable
from router.request.attempt import Attempt
from router.request.classify import Classification
from router.request.resume import Seam, broken_output_tokens, resumed_usage

__all__ = [
    "SEAM_BROKEN",
    "SEAM_UNVERIFIED",
    "SeamBroken",
    "StreamOwner",
    "StreamRelay",
    "first_content",
    "has_content",
]

# What in a delta is content the client must see (text, a tool call, a refusal, spoken
# audio, the legacy function call): the first of these commits the stream.
# Thinking (the Anthropic driver's extension fields, router/drivers/anthropic.py) is content
# the client sees, and no prefill can continue it.
_CONTENT_KEYS: Final = (
    "content",
    "tool_calls",
    "refusal",
    "audio",
    "function_call",
    "reasoning_content",
    "thinking_blocks",
)
_OTHER_CONTENT_KEYS: Final = _CONTENT_KEYS[1:]  # what a resume cannot continue

# A resume whose continuation cannot be joined to what the client has: the upstream did
# answer (its usage is held unknown), and nothing more can be done for the stream.
SEAM_BROKEN: Final = Classification(
    failure_class=ev.FailureClass.UPSTREAM_UNAVAILABLE,
    evidence=ev.Evidence.STARTED,
    breaker_scope=None,
    breaker_opens_at_once=False,
    may_fail_over="no",
)
SEAM_UNVERIFIED: Final = "resume_seam_unverified"  # such an attempt's error code


class SeamBroken(Exception):
    """A resume's continuation cannot be joined to the text the client has."""


class StreamOwner(Protocol):
    """What the relay asks of the request it relays (the executor)."""

    @property
    def request_id(self) -> str: ...

    async def resume(self, broken: Attempt) -> Attempt:
        """Record ``broken``'s failure and carry on as the walk says: the attempt whose
        continuation follows, up to its first content; raises the request's
        :class:`GatewayError` (recorded) when the walk ends it instead."""
        ...

    async def finished(self, attempt: Attempt) -> None:
        """Record the stream's success (raises if the ledger cannot)."""
        ...

    def left(self, attempt: Attempt) -> None:
        """The client went away from the committed stream: record it, in a task of its own."""
        ...


class StreamRelay:
    """One request's stream as the client has it."""

    __slots__ = (
        "_attempt_text",
        "_broken_output",
        "_can_resume",
        "_delivered",
        "_include_usage",
        "_noting",
        "_owner",
        "_writer",
        "chunk_id",
        "response_model",
        "resumable",
    )

    def __init__(self, owner: StreamOwner, *, include_usage: bool, can_resume: bool) -> None:
        """``include_usage``: the client asked for the final usage chunk; ``can_resume``: a
        mapping of the group can continue a broken stream, so its text is worth keeping."""
        self._owner = owner
        self._include_usage = include_usage
        self._can_resume = can_resume
        # The committed stream as the client has it: its text so far (for a resume),
        # whether that can be continued, and the id and model its chunks carry.
        self._delivered: list[str] = []
        # Where the text of the attempt now streaming starts in it, and the output tokens
        # the stream's broken attempts count for in the client's final usage.
        self._attempt_text = 0
        self._broken_output = 0
        self.resumable = True
        self.chunk_id: str | None = None
        self.response_model: str | None = None
        self._writer: Callable[[bytes], bool] | None = None
        # Whether a delivered read may still have something to note (_note_delivered).
        self._noting = True

    def delivered(self) -> str:
        """The text the client has."""
        return "".join(self._delivered)

    def write_directly(self, writer: Callable[[bytes], bool]) -> None:
        """See :attr:`router.request.call.StreamingCompletion.write_directly`."""
        self._writer = writer

    async def hold_first_content(self, attempt: Attempt, upstream: DriverStream) -> None:
        """Read ``attempt``'s stream up to its first content, which is held on the attempt
        for :meth:`body` (a resume's: joined to what the client has, or :class:`SeamBroken`).
        The upstream is closed if this fails."""
        held_raw = None
        try:
            batches = upstream.batches()
            if attempt.seam is None:
                held, held_raw = await first_content(batches, upstream)
            else:
                held, _ = await first_content(self._continuation(attempt, batches), None)
                if attempt.seam.state != "joined" and not attempt.seam.end():
                    raise SeamBroken
        except BaseException:
            await upstream.aclose()
            raise
        attempt.upstream, attempt.batches, attempt.held = upstream, batches, held
        attempt.held_raw = held_raw

    async def body(self, attempt: Attempt) -> AsyncGenerator[bytes, None]:
        """The client's bytes: a read's chunks go out together, as one piece. The read that
        ended the upstream's stream (its finish chunk, usage and end) goes out with the
        gateway's own end, once the completion is recorded, as a buffered answer does: one
        piece and one write fewer per stream. A stream that breaks is resumed where the walk
        says so (router.request.walk): the continuation's chunks follow on the same stream."""
        owner = self._owner
        finished = False
        last = b""
        try:
            while True:
                upstream, batches = attempt.upstream, attempt.batches
                assert upstream is not None and batches is not None
                # A resume's chunks are rewritten (router.request.resume); the others go out
                # as the upstream's bytes where it has them (DriverStream.raw) and nothing is
                # dropped from them: they were parsed only for what the ledger and a resume
                # need (_note_delivered).
                passed = attempt.seam is None
                if not passed:
                    batches = self._continuation(attempt, batches)
                try:
                    batch: list[dict[str, Any]] | None = attempt.held
                    raw = attempt.held_raw
                    attempt.held, attempt.held_raw = [], None
                    while batch is not None:
                        piece = self._piece(batch, raw)
                        # The next read is what a stream waits for most of its life: the
                        # chunks and bytes of this one are not held meanwhile.
                        batch = raw = None
                        if piece and upstream.ended:
                            last = piece
                        elif piece:
                            yield piece
                        del piece
                        if passed and self._writer is not None:
                            upstream.tap(self.deliver)  # until a read it cannot take
                        batch = await anext(batches, None)
                        raw = upstream.raw if passed else None
                    if attempt.seam is not None and not attempt.seam.end():
                        raise SeamBroken
                except (UpstreamFailure, SeamBroken) as failure:
                    if isinstance(failure, UpstreamFailure):
                        attempt.classification, attempt.failure = failure.classification, failure
                    else:
                        attempt.classification = SEAM_BROKEN
                        attempt.error_code = SEAM_UNVERIFIED
                    await upstream.aclose()
                    self._count_broken(upstream)
                    try:
                        attempt = await owner.resume(attempt)
                    except GatewayError as error:
                        finished = True
                        yield last + _error_event(error, owner.request_id)
                        return
                    continue
                break
            try:
                await owner.finished(attempt)
            except LedgerUnavailable:
                # The completion is not recorded (its end is, once the ledger is back:
                # Endings.unrecorded), so neither the held last read nor [DONE] goes out: the
                # stream ends with the error, as a broken one does, and nothing reaches the
                # server as an exception to log with its traceback.
                finished = True
                yield _error_event(ledger_unavailable(), owner.request_id)
                return
            finished = True
            yield last + DONE_FRAME
        finally:
            if not finished:
                # The client went away (this task is being cancelled): record it anyway, in
                # a task of its own that the cancellation does not reach.
                owner.left(attempt)
            if attempt.upstream is not None:
                await attempt.upstream.aclose()

    def deliver(self, batch: list[dict[str, Any]], raw: bytes) -> bool:
        """A tapped read (DriverStream.tap) of a stream relayed as the upstream's bytes:
        written to the client now, unless it is not to go out as it came (a usage chunk
        the client did not ask for) or the writer cannot take it now; then the relay's
        task gets it, in order."""
        writer = self._writer
        if writer is None:
            return False
        if not self._include_usage:
            for chunk in batch:  # _is_usage_chunk, inline: a tapped read's one check
                if chunk.get("choices") == [] and chunk.get("usage") is not None:
                    return False
        if not writer(raw):
            return False
        if self._noting:
            self._note_delivered(batch)
        return True

    def _count_broken(self, upstream: DriverStream) -> None:
        """The attempt now streaming broke: count its output for the final usage (the text
        it delivered, or what it reported if more), and start the next attempt's text."""
        text = "".join(self._delivered[self._attempt_text :])
        reported = upstream.usage.output_tokens if upstream.usage is not None else None
        self._broken_output += broken_output_tokens(text, reported)
        self._attempt_text = len(self._delivered)

    async def _continuation(
        self, attempt: Attempt, batches: AsyncIterator[list[dict[str, Any]]]
    ) -> AsyncIterator[list[dict[str, Any]]]:
        """A resume's chunks as the client's stream goes on: what the client already has
        stripped (router.request.resume.Seam), no second role preamble, the stream's own id,
        its usage that of the whole stream."""
        seam = attempt.seam
        assert seam is not None
        async for batch in batches:
            joined = [
                self._stream_usage(c)
                for c in (_continued(chunk, seam, self.chunk_id) for chunk in batch)
                if c
            ]
            if seam.state == "broken":
                raise SeamBroken
            if joined:
                yield joined

    def _stream_usage(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A continuation's chunk with the usage the client is told for the whole stream
        (contract §5 "Resume"); a new dict, the driver's own totals untouched."""
        usage = chunk.get("usage")
        if not isinstance(usage, dict):
            return chunk
        return {**chunk, "usage": resumed_usage(usage, self._broken_output)}

    def _piece(self, batch: list[dict[str, Any]], raw: bytes | None) -> bytes:
        """A read's chunks as the client's bytes (``raw``, the upstream's, if given and
        nothing is dropped), without a usage chunk the client did not ask for; b"" if
        nothing is left."""
        self._note_delivered(batch)
        if not self._include_usage:
            kept = [chunk for chunk in batch if not _is_usage_chunk(chunk)]
            if len(kept) != len(batch):
                batch, raw = kept, None
        if not batch:
            return b""
        return raw if raw is not None else encode_json(batch)

    def _note_delivered(self, batch: list[dict[str, Any]]) -> None:
        """Keep the text the client has, for a resume; anything but the text of one choice
        (a tool call, a refusal, audio, a second choice) cannot be continued. A group none
        of whose mappings can resume keeps only the stream's id and model: once it has
        them, there is nothing more to note (:attr:`_noting`)."""
        if not self._can_resume and self.chunk_id is not None and self.response_model is not None:
            self._noting = False
            return
        for chunk in batch:
            if self.chunk_id is None and isinstance(chunk.get("id"), str):
                self.chunk_id = chunk["id"]
            if self.response_model is None and isinstance(chunk.get("model"), str):
                self.response_model = chunk["model"]
            if not self._can_resume:
                continue
            for choice in chunk.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                if choice.get("index", 0) != 0:
                    self.resumable = False
                if not isinstance(delta, dict):
                    continue
                content = delta.get("content")
                if isinstance(content, str):
                    self._delivered.append(content)
                for key in _OTHER_CONTENT_KEYS:
                    if delta.get(key):
                        self.resumable = False
                        break


async def first_content(
    batches: AsyncIterator[list[dict[str, Any]]], upstream: DriverStream | None
) -> tuple[list[dict[str, Any]], bytes | None]:
    """Pull chunks until one carries content (contract §5); return all pulled so far, and
    (given the upstream whose batches they are) the same as its bytes, if it has them all."""
    held: list[dict[str, Any]] = []
    raw: list[bytes] | None = [] if upstream is not None else None
    async for batch in batches:
        held += batch
        if raw is not None:
            piece = upstream.raw if upstream is not None else None
            raw = None if piece is None else [*raw, piece]
        if any(has_content(chunk) for chunk in batch):
            break
    return held, None if raw is None else b"".join(raw)


def has_content(chunk: Mapping[str, Any]) -> bool:
    """Whether ``chunk`` carries something the client must see: it commits the stream."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(key) for key in _CONTENT_KEYS):
            return True
    return False


def _is_usage_chunk(chunk: Mapping[str, Any]) -> bool:
    # The final usage chunk the gateway asked for on its own account (choices == []).
    return chunk.get("choices") == [] and chunk.get("usage") is not None


def _continued(chunk: dict[str, Any], seam: Seam, chunk_id: str | None) -> dict[str, Any] | None:
    """A continuation's chunk as the client's stream goes on (None: nothing left of it)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return _with_id(chunk, chunk_id)  # the usage chunk
    choice = choices[0]
    if not isinstance(choice, dict) or not isinstance(choice.get("delta"), dict):
        return _with_id(chunk, chunk_id)
    delta = {k: v for k, v in choice["delta"].items() if k != "role"}
    content = delta.get("content")
    if isinstance(content, str):
        delta["content"] = seam.feed(content)
        if not delta["content"]:
            del delta["content"]
    if not delta and not choice.get("finish_reason") and chunk.get("usage") is None:
        return None
    return _with_id({**chunk, "choices": [{**choice, "delta": delta}, *choices[1:]]}, chunk_id)


def _with_id(chunk: dict[str, Any], chunk_id: str | None) -> dict[str, Any]:
    if chunk_id is None or "id" not in chunk:
        return chunk
    return {**chunk, "id": chunk_id}


def _error_event(error: GatewayError, request_id: str) -> bytes:
    """The stream's final SSE event, its error."""
    return encode_json([{"error": _in_band(error, request_id)}])


def _in_band(error: GatewayError, request_id: str) -> dict[str, Any]:
    """The final SSE error event's ``error`` member."""
    return {
        "code": error.code,
        "message": error.message,
        "type": error.error_type,
        "request_id": request_id,
    }
