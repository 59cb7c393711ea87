"""Frozen dataclasses made and copied cheaply.

``read_only``: a slots dataclass that the type checker holds frozen, built at an unfrozen one's
cost, for records made many times a request whose fields nobody assigns.

``evolve``: copies of frozen dataclasses with some fields changed, without running ``__init__``.

``dataclasses.replace`` gathers every field into keyword arguments and runs the class's
``__init__``, which sets each field of a frozen class through ``object.__setattr__``;
``evolve`` copies the slots directly, in much less time (bench/README.md "Decisions"), for
the eight copies a request makes (its walk, its breaker records, its route). It serves
frozen ``slots=True`` dataclasses with no ``__post_init__`` (so ``__init__`` checks nothing
a copy could skip), which it verifies once per class.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar, dataclass_transform

__all__ = ["evolve", "read_only"]

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def read_only(cls: type[_T]) -> type[_T]:
    """``@dataclass(frozen=True, slots=True)`` to the type checker, ``@dataclass(slots=True)``
    at run time. A frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, several times the cost of an unfrozen one's (see bench/README.md,
    Decisions: "Issue 44's levers for short requests"); a record whose immutability is a
    promise kept by its callers (checked by mypy, which rejects any assignment to its fields)
    need not pay it at run time. Not hashable: nothing may use such a record as a key."""
    return dataclasses.dataclass(slots=True)(cls)


_Slot = tuple[str, Callable[[Any], Any], Callable[[Any, Any], None]]


@functools.cache
def _slots(cls: type) -> tuple[_Slot, ...]:
    """Each field's name and its slot's getter and setter."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"evolve needs a frozen slots dataclass, not {cls.__qualname__}")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"evolve would skip {cls.__qualname__}.__post_init__")
    slots = []
    for field in dataclasses.fields(cls):
        member = getattr(cls, field.name)  # the slot's descriptor (a base class's too)
        slots.append((field.name, member.__get__, member.__set__))
    return tuple(slots)


def evolve(record: _T, **changes: Any) -> _T:
    """``dataclasses.replace(record, **changes)`` for a frozen slots dataclass."""
    cls: type = type(record)
    slots = _slots(cls)
    copy: _T = object.__new__(cls)
    for name, get, set_ in slots:
        set_(copy, changes.pop(name) if name in changes else get(record))
    if changes:
        raise TypeError(f"{cls.__qualname__} has no field {next(iter(changes))!r}")
    return copy
