"""The append writes each event's stored bytes from parts it encoded once; those bytes must
be exactly ``canonical_payload``'s, whatever the data (the hash chain and ``verify`` rest
on them)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from ledger.store import canonical_payload
from ledger.store.recorded import payloads_from_parts

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_JSON = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=20,
)
_OBJECTS = st.dictionaries(st.text(), _JSON, max_size=6)


@given(
    stream_id=st.text(min_size=1, max_size=200),
    first_version=st.integers(min_value=1, max_value=2**31 - 10),
    events=st.lists(
        st.tuples(
            st.text(min_size=1, max_size=100), st.integers(min_value=1, max_value=1000), _OBJECTS
        ),
        min_size=1,
        max_size=4,
    ),
    metadata=_OBJECTS,
    recorded_at=st.datetimes().map(lambda moment: moment.isoformat()),
)
def test_the_payloads_from_encoded_parts_are_the_canonical_payloads(
    stream_id: str,
    first_version: int,
    events: list[tuple[str, int, dict[str, Any]]],
    metadata: dict[str, Any],
    recorded_at: str,
) -> None:
    sorted_json = orjson.OPT_SORT_KEYS
    encoded = [
        SimpleNamespace(
            type_json=orjson.dumps(event_type),
            schema_version=schema_version,
            data_json=orjson.dumps(data, option=sorted_json),
        )
        for event_type, schema_version, data in events
    ]
    assert payloads_from_parts(
        stream_id=orjson.dumps(stream_id),
        first_version=first_version,
        events=encoded,
        metadata=orjson.dumps(metadata, option=sorted_json),
        recorded_at=orjson.dumps(recorded_at),
    ) == [
        canonical_payload(
            stream_id=stream_id,
            version=first_version + offset,
            event_type=event_type,
            schema_version=schema_version,
            data=data,
            metadata=metadata,
            recorded_at=recorded_at,
        )
        for offset, (event_type, schema_version, data) in enumerate(events)
    ]
