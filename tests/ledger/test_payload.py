"""The append writes each event's stored bytes from parts it encoded once; those bytes must
be exactly ``canonical_payload``'s, whatever the data (the hash chain and ``verify`` rest
on them)."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from ledger.store import canonical_payload
from ledger.store.recorded import payload_from_parts

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
    version=st.integers(min_value=1, max_value=2**31 - 1),
    event_type=st.text(min_size=1, max_size=100),
    schema_version=st.integers(min_value=1, max_value=1000),
    data=_OBJECTS,
    metadata=_OBJECTS,
    recorded_at=st.datetimes().map(lambda moment: moment.isoformat()),
)
def test_the_payload_from_encoded_parts_is_the_canonical_payload(
    stream_id: str,
    version: int,
    event_type: str,
    schema_version: int,
    data: dict[str, Any],
    metadata: dict[str, Any],
    recorded_at: str,
) -> None:
    sorted_json = orjson.OPT_SORT_KEYS
    assert payload_from_parts(
        stream_id=orjson.dumps(stream_id),
        version=version,
        event_type=orjson.dumps(event_type),
        schema_version=schema_version,
        data=orjson.dumps(data, option=sorted_json),
        metadata=orjson.dumps(metadata, option=sorted_json),
        recorded_at=orjson.dumps(recorded_at),
    ) == canonical_payload(
        stream_id=stream_id,
        version=version,
        event_type=event_type,
        schema_version=schema_version,
        data=data,
        metadata=metadata,
        recorded_at=recorded_at,
    )
