"""Disabled endpoints (contract §5 "Disabled endpoints"), as the ledger holds them.

The stream ``endpoints`` is the truth: ``EndpointDisabled`` when an upstream refused an
endpoint's credentials, ``EndpointEnabled`` when an operator (or a new key) lifted that.
:class:`EndpointStates` is the fold of that stream up to a version: pure, and cheap to
bring up to date (:func:`read_states` reads only the events after the version it has). Every
gateway keeps one in memory (``router.adapters.disabling``); the CLI reads one to enable an
endpoint.

Writes expect the stream at the version the writer folded, so two writers deciding on the
same state never both append: the one that lost reads what changed and decides again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal, TypeVar

from ledger import events as ev
from ledger.store import EventStore, RecordedEvent, WrongExpectedVersion

__all__ = [
    "ENDPOINTS_STREAM",
    "DisabledEndpoint",
    "EndpointStates",
    "read_states",
    "record_disabled",
    "record_enabled",
]

ENDPOINTS_STREAM: Final = "endpoints"
_ATTEMPTS: Final = 8
"""Appends tried before giving up on a stream other writers keep moving."""


@dataclass(frozen=True, slots=True)
class DisabledEndpoint:
    """One endpoint disabled, with the evidence (never the key)."""

    endpoint: str
    http_status: int | None
    error_code: str | None
    key_check: str | None
    request_id: str | None
    attempt_id: str | None
    config_generation: str
    disabled_at: datetime
    position: int  # of its EndpointDisabled in the ledger

    def as_json(self) -> dict[str, Any]:
        """The evidence as ``GET /v1/endpoints`` shows it (the key check is not shown)."""
        return {
            "disabled_at": self.disabled_at.isoformat(),
            "http_status": self.http_status,
            "error_code": self.error_code,
            "request_id": self.request_id,
            "attempt_id": self.attempt_id,
            "config_generation": self.config_generation,
            "position": self.position,
        }


@dataclass(frozen=True, slots=True)
class EndpointStates:
    """The ``endpoints`` stream folded up to ``version``."""

    version: int = 0
    disabled: Mapping[str, DisabledEndpoint] = field(default_factory=dict)
    named: frozenset[str] = frozenset()  # every endpoint the stream has named

    def apply(self, recorded: Sequence[RecordedEvent]) -> EndpointStates:
        """These states with the stream's later events folded in (earlier ones, which they
        already hold, are skipped)."""
        disabled = dict(self.disabled)
        named = set(self.named)
        version = self.version
        for record in recorded:
            if record.version <= version:
                continue
            version = record.version
            event = record.event()
            match event:
                case ev.EndpointDisabled():
                    named.add(event.endpoint)
                    disabled[event.endpoint] = DisabledEndpoint(
                        endpoint=event.endpoint,
                        http_status=event.http_status,
                        error_code=event.error_code,
                        key_check=event.key_check,
                        request_id=event.request_id,
                        attempt_id=event.attempt_id,
                        config_generation=event.config_generation,
                        disabled_at=record.recorded_at,
                        position=record.position,
                    )
                case ev.EndpointEnabled():
                    named.add(event.endpoint)
                    disabled.pop(event.endpoint, None)
        if version == self.version:
            return self
        return EndpointStates(version=version, disabled=disabled, named=frozenset(named))


async def read_states(store: EventStore, since: EndpointStates | None = None) -> EndpointStates:
    """The states as the ledger has them now: ``since`` brought up to date."""
    since = since or EndpointStates()
    return since.apply(await store.read_stream(ENDPOINTS_STREAM, since.version))


async def record_enabled(
    store: EventStore,
    endpoint: str,
    *,
    cause: Literal["operator", "key_changed"],
    actor: str | None,
    generation: str | None,
    states: EndpointStates | None = None,
    lifts: Callable[[DisabledEndpoint], bool] = lambda _: True,
) -> tuple[EndpointStates, ev.EndpointEnabled | None]:
    """Enable ``endpoint`` if the ledger has it disabled and ``lifts`` says this lifts that
    disabling (a new key lifts only another key's); the states after, and the event
    appended (None: nothing to lift, nothing recorded)."""
    enabled = ev.EndpointEnabled(
        endpoint=endpoint, cause=cause, actor=actor, config_generation=generation
    )

    def wanted(current: DisabledEndpoint | None) -> bool:
        return current is not None and lifts(current)

    return await _append_unless(store, endpoint, enabled, wanted, states)


async def record_disabled(
    store: EventStore, disabled: ev.EndpointDisabled, states: EndpointStates | None = None
) -> tuple[EndpointStates, bool]:
    """Disable an endpoint unless the ledger already has it disabled for the same key; the
    states after, and whether this call recorded it."""

    def wanted(current: DisabledEndpoint | None) -> bool:
        return current is None or current.key_check != disabled.key_check

    states, appended = await _append_unless(store, disabled.endpoint, disabled, wanted, states)
    return states, appended is not None


_E = TypeVar("_E", bound=ev.Event)


async def _append_unless(
    store: EventStore,
    endpoint: str,
    event: _E,
    wanted: Callable[[DisabledEndpoint | None], bool],
    states: EndpointStates | None,
) -> tuple[EndpointStates, _E | None]:
    # Decided on the states folded so far and appended at their version: if another writer
    # moved the stream meanwhile, the append fails whole and the decision is taken again
    # on what it wrote.
    states = await read_states(store, states)
    for _ in range(_ATTEMPTS):
        if not wanted(states.disabled.get(endpoint)):
            return states, None
        try:
            recorded = await store.append(ENDPOINTS_STREAM, states.version, [event])
        except WrongExpectedVersion:
            states = await read_states(store, states)
            continue
        return states.apply(recorded), event
    raise WrongExpectedVersion(ENDPOINTS_STREAM, states.version, states.version + 1)
