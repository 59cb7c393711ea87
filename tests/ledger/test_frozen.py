"""``evolve``: the copy ``dataclasses.replace`` makes, for frozen slots dataclasses."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.support.frozen import direct_init, evolve


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


# --- direct_init ---------------------------------------------------------------------------


def _factory() -> list[int]:
    return [7]


@dataclasses.dataclass(frozen=True, slots=True)
class _Written:
    """Built by the ``__init__`` dataclasses write, for comparison."""

    a: int
    b: str = "b"
    c: tuple[int, ...] = ()
    d: list[int] = dataclasses.field(default_factory=_factory)
    e: int = 5
    f: int = dataclasses.field(default=6, init=False)
    g: int = dataclasses.field(default=9, kw_only=True)


@direct_init
@dataclasses.dataclass(frozen=True, slots=True)
class _Twinned:  # as many fields as _Written: filled as its twin
    a: int
    b: str = "b"
    c: tuple[int, ...] = ()
    d: list[int] = dataclasses.field(default_factory=_factory)
    e: int = 5
    f: int = dataclasses.field(default=6, init=False)
    g: int = dataclasses.field(default=9, kw_only=True)


@direct_init
@dataclasses.dataclass(frozen=True, slots=True)
class _Small:  # too few fields for a twin: filled through its slots' descriptors
    a: int
    d: list[int] = dataclasses.field(default_factory=_factory)


def _as_tuple(record: object) -> tuple[object, ...]:
    return tuple(getattr(record, f.name) for f in dataclasses.fields(record))  # type: ignore[arg-type]


@given(
    a=st.integers(),
    more=st.fixed_dictionaries(
        {},
        optional={
            "b": st.text(),
            "c": st.lists(st.integers()).map(tuple),
            "d": st.lists(st.integers()),
            "e": st.integers(),
            "g": st.integers(),
        },
    ),
)
def test_direct_init_builds_what_the_written_init_builds(a: int, more: dict[str, Any]) -> None:
    built = _Twinned(a, **more)
    assert type(built) is _Twinned
    assert _as_tuple(built) == _as_tuple(_Written(a, **more))
    assert built == _Twinned(a, **more)
    assert repr(built).removeprefix("_Twinned") == repr(_Written(a, **more)).removeprefix(
        "_Written"
    )


def test_direct_init_keeps_defaults_factories_and_keyword_only_fields() -> None:
    first, second = _Twinned(1), _Twinned(1)
    assert first.d == [7] and first.d is not second.d  # a new list each time
    assert (first.f, first.g) == (6, 9)
    assert _Small(1).d == [7] and _Small(1, [2]).d == [2]
    with pytest.raises(TypeError):
        _Twinned(1, "b", (), [], 5, 8)  # type: ignore[call-arg]  # g is keyword-only
    with pytest.raises(TypeError):
        _Twinned()  # type: ignore[call-arg]


@pytest.mark.parametrize("record", [_Twinned(1), _Small(1)])
def test_a_directly_built_record_is_frozen(record: Any) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.a = 2


def test_direct_init_refuses_classes_it_could_not_serve() -> None:
    for cls in (_NoSlots, _NotFrozen, _Checked):
        with pytest.raises(TypeError, match=cls.__qualname__):
            direct_init(cls)


def test_evolve_copies_a_twinned_record() -> None:
    record = _Twinned(1, "x", g=3)
    copy = evolve(record, b="y")
    assert type(copy) is _Twinned
    assert _as_tuple(copy) == _as_tuple(dataclasses.replace(record, b="y"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.b = "z"  # type: ignore[misc]


@direct_init
@dataclasses.dataclass(frozen=True, slots=True)
class _Builtins:  # fields named as builtins the generated code could have used
    type: str
    id: int
    len: int
    object: str
    setattr: str
    getattr: str


def test_fields_named_as_builtins_are_filled_and_copied() -> None:
    record = _Builtins("t", 1, 2, "o", "s", "g")
    assert (record.type, record.id, record.object) == ("t", 1, "o")
    assert evolve(record, type="u") == _Builtins("u", 1, 2, "o", "s", "g")


def test_a_field_named_as_the_generated_code_s_own_is_refused() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Named:
        record: int

    with pytest.raises(TypeError, match="'record'"):
        direct_init(Named)
