"""How a recorded payload is refused or brought up to date: the catalogue's errors, and
the upcasters that turn an older schema version of an event's payload into the current one
(``ledger.events.decode_event`` applies them before validating)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


def _key_created_1_to_2(payload: dict[str, Any]) -> dict[str, Any]:
    # Schema 1 called the key's name ``label`` (contract §3 "Keys" says ``name``); nothing
    # else changed: ``expires_at`` and ``limits`` are absent from every older key.
    renamed = {k: v for k, v in payload.items() if k != "label"}
    renamed["name"] = payload.get("label")
    return renamed


UPCASTERS: Mapping[tuple[str, int], Upcaster] = {
    ("KeyCreated", 1): _key_created_1_to_2,
}
"""(type, old schema version) → function returning the payload at version + 1."""


class EventValidationError(ValueError):
    """An event that the catalogue refuses; nothing is written."""


class UnknownEventType(EventValidationError):
    def __init__(self, event_type: str) -> None:
        super().__init__(f"unknown event type {event_type!r}: not in the event catalogue")
        self.event_type = event_type


class InvalidEventPayload(EventValidationError):
    def __init__(self, event_type: str, error: ValidationError) -> None:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<payload>'}: {e['msg']}"
            for e in error.errors()
        )
        super().__init__(f"invalid {event_type} payload: {problems}")
        self.event_type = event_type


def upcast(
    event_type: str, schema_version: int, current_version: int, data: Mapping[str, Any]
) -> dict[str, Any]:
    """``data``, recorded at ``schema_version``, as the payload of ``current_version``."""
    payload = dict(data)
    version = schema_version
    while version < current_version:
        upcaster = UPCASTERS.get((event_type, version))
        if upcaster is None:
            raise EventValidationError(
                f"no upcaster for {event_type} schema version {version} → {version + 1}"
            )
        payload = upcaster(payload)
        version += 1
    if version != current_version:
        raise EventValidationError(
            f"{event_type} schema version {schema_version} is newer than this code's "
            f"{current_version}"
        )
    return payload
