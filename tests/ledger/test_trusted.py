"""``Record.trusted`` builds what validation builds: the same fields in the same order, the
same fields given, the same JSON to the byte (so the same hash chain), for every record type
the gateway builds trusted, over generated values of each field's type and bounds."""

from __future__ import annotations

import types
from decimal import Decimal
from enum import Enum
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticUndefined

from ledger import events as ev
from ledger.values import Record
from tests.trusted import assert_same_record

# Every type built trusted on the request path (router/request/records.py, budget.py,
# selection.py, router/doors/chat.py).
TRUSTED_TYPES: tuple[type[Record], ...] = (
    ev.Requirements,
    ev.Candidate,
    ev.RouteChoice,
    ev.AccountRef,
    ev.RequestReceived,
    ev.RouteEvaluated,
    ev.BudgetReserved,
    ev.AttemptStarted,
    ev.StreamCommitted,
    ev.AttemptFinished,
    ev.BudgetSettled,
    ev.BudgetReleased,
    ev.RequestCompleted,
)


def _base(tp: Any, pattern: str | None) -> st.SearchStrategy[Any]:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return st.one_of(*(_base(arg, pattern) for arg in get_args(tp)))
    if origin is Annotated:
        return _field(tp)
    if tp is type(None):
        return st.none()
    if origin is Literal:
        return st.sampled_from(get_args(tp))
    if origin is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_base(args[0], None), max_size=3).map(tuple)
        return st.tuples(*(_base(arg, None) for arg in args))
    if isinstance(tp, type) and issubclass(tp, Record):
        return records(tp)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return st.sampled_from(list(tp))
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(min_value=-2, max_value=10**9)
    if tp is Decimal:
        return st.decimals(min_value=0, max_value=10**6, places=8, allow_nan=False)
    if tp is str:
        return st.from_regex(pattern, fullmatch=True) if pattern else st.text(max_size=12)
    raise AssertionError(f"no strategy for {tp!r}")


def _field(annotation: Any, metadata: list[Any] | None = None) -> st.SearchStrategy[Any]:
    """Values of a field as validation returns them (the types a trusted caller passes)."""
    if metadata is None and get_origin(annotation) is Annotated:
        annotation, *metadata = get_args(annotation)
    metadata = metadata or []
    pattern = next((m.pattern for m in metadata if getattr(m, "pattern", None)), None)
    adapter: TypeAdapter[Any] = TypeAdapter(
        Annotated[(annotation, *metadata)] if metadata else annotation
    )

    def valid(value: Any) -> Any:
        try:
            return adapter.validate_python(value)
        except ValidationError:
            return PydanticUndefined

    return _base(annotation, pattern).map(valid).filter(lambda v: v is not PydanticUndefined)


@st.composite
def _values(draw: st.DrawFn, cls: type[Record]) -> dict[str, Any]:
    """Every required field, and some of the optional ones, in the fields' order."""
    values = {}
    for name, info in cls.model_fields.items():
        if info.is_required() or draw(st.booleans()):
            values[name] = draw(_field(info.annotation, list(info.metadata)))
    return values


def records(cls: type[Record]) -> st.SearchStrategy[Record]:
    return _values(cls).map(lambda values: cls(**values))


@pytest.mark.parametrize("cls", TRUSTED_TYPES, ids=lambda cls: cls.__name__)
@given(data=st.data())
def test_a_trusted_record_is_its_validated_twin(cls: type[Record], data: st.DataObject) -> None:
    values = data.draw(_values(cls))
    names = list(values)
    order = data.draw(st.permutations(names))  # a caller's own order of keywords
    values = {name: values[name] for name in order}
    assert_same_record(cls.trusted(**values), cls(**values))


def test_a_trusted_record_refuses_an_unknown_or_missing_field() -> None:
    with pytest.raises(TypeError, match="unknown fields \\['colour'\\]"):
        ev.Usage.trusted(input_tokens=1, output_tokens=2, colour="red")
    with pytest.raises(TypeError, match="missing \\['output_tokens'\\]"):
        ev.Usage.trusted(input_tokens=1)


def test_a_record_with_validators_of_its_own_is_never_built_trusted() -> None:
    with pytest.raises(TypeError, match="validators of its own"):
        ev.KeyLimits.trusted(requests_per_minute=1)


def test_a_gateway_process_can_check_its_trusted_records(monkeypatch: pytest.MonkeyPatch) -> None:
    # WAYBILL_CHECK_TRUSTED=1 (set by tests/conftest.py for the gateways tests start): a
    # trusted record that is not its validated twin fails where it is built.
    import ledger.values as values

    monkeypatch.setattr(values, "CHECK_TRUSTED", True)
    assert values.Usage.trusted(input_tokens=3, output_tokens=4) == values.Usage(
        input_tokens=3, output_tokens=4
    )
    with pytest.raises(AssertionError, match="not its twin"):
        values.Usage.trusted(input_tokens="3", output_tokens=4)
