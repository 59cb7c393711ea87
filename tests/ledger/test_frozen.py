"""``evolve``: the copy ``dataclasses.replace`` makes, for frozen slots dataclasses."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.support.frozen import evolve, read_only


@dataclasses.dataclass(frozen=True, slots=True)
class _Base:
    a: int
    b: str = "b"


@dataclasses.dataclass(frozen=True, slots=True)
class _Derived(_Base):
    c: tuple[int, ...] = ()
    d: frozenset[str] = dataclasses.field(default_factory=frozenset)


@given(
    a=st.integers(),
    b=st.text(),
    c=st.lists(st.integers()).map(tuple),
    changes=st.fixed_dictionaries(
        {},
        optional={
            "a": st.integers(),
            "b": st.text(),
            "c": st.lists(st.integers()).map(tuple),
            "d": st.frozensets(st.text()),
        },
    ),
)
def test_evolve_makes_the_copy_replace_makes(
    a: int, b: str, c: tuple[int, ...], changes: dict[str, object]
) -> None:
    record = _Derived(a, b, c)
    copy = evolve(record, **changes)
    assert copy == dataclasses.replace(record, **changes)  # type: ignore[arg-type]
    assert type(copy) is _Derived
    assert record == _Derived(a, b, c)  # the original is untouched


def test_the_copy_is_frozen() -> None:
    copy = evolve(_Base(1), b="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.a = 2  # type: ignore[misc]


def test_an_unknown_field_is_refused() -> None:
    with pytest.raises(TypeError, match="no field 'z'"):
        evolve(_Base(1), z=3)


@dataclasses.dataclass(frozen=True)
class _NoSlots:
    a: int


@dataclasses.dataclass(slots=True)
class _NotFrozen:
    a: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Checked:
    a: int

    def __post_init__(self) -> None:
        if self.a < 0:
            raise ValueError("negative")


@pytest.mark.parametrize("record", [_NoSlots(1), _NotFrozen(1), _Checked(1)])
def test_classes_a_copy_could_not_serve_are_refused(record: object) -> None:
    with pytest.raises(TypeError, match=type(record).__qualname__):
        evolve(record, a=-1)


@read_only
class _ReadOnly:
    a: int
    b: str = dataclasses.field(default="b", compare=False)


def test_a_read_only_record_is_a_slots_dataclass_compared_by_its_fields() -> None:
    # Frozen to the type checker only (mypy rejects `record.a = 2`): no __dict__, the fields'
    # equality and repr, as the frozen dataclass it stands for.
    record = _ReadOnly(1, "x")
    assert not hasattr(record, "__dict__")
    assert record == _ReadOnly(1, "y") and record != _ReadOnly(2, "x")
    assert repr(record) == "_ReadOnly(a=1, b='x')"
    assert [f.name for f in dataclasses.fields(_ReadOnly)] == ["a", "b"]
