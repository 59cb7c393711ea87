"""Frozen slots dataclasses built and copied without ``object.__setattr__`` per field.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` (its own
``__setattr__`` refuses), and ``dataclasses.replace`` gathers every field into keyword
arguments and runs that ``__init__``: on the request path, a few microseconds per object.
For a frozen ``slots=True`` class there are two cheaper ways to fill the slots, and
:func:`direct_init` (a class's ``__init__``) and :func:`evolve` (a copy with some fields
changed) take the cheaper one for the class:

- its *twin*: a plain class with the same slots, whose instances take each field by an
  ordinary (and specialised) attribute store; the object is the twin's while it is filled
  and the frozen class's once it is (``__class__`` assignment, allowed between classes of
  one layout). Two assignments of ``__class__`` cost about what five fields set through
  ``object.__setattr__`` do, so a class of fewer fields, or one whose base is not
  ``object``, has its slots set through their descriptors instead;
- each slot's descriptor, called directly (about half of ``object.__setattr__``'s cost).

Figures: bench/README.md "Decisions". Instances stay frozen: only their construction
changes. Both serve frozen slots dataclasses with no ``__post_init__`` (so nothing is
checked a copy could skip) and verify each class once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final, TypeVar

__all__ = ["direct_init", "evolve"]

_T = TypeVar("_T")
_C = TypeVar("_C", bound=type)

# From this many fields up a frozen class is filled as its twin (two __class__ assignments),
# below through each slot's descriptor (bench/README.md "Decisions").
_TWIN_FROM_FIELDS: Final = 6


class _Keep:
    """A copy's default for each field: the original's value."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<keep>"


class _Factory:
    """A parameter's default where its field has a default factory (as dataclasses show it)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<factory>"


_KEEP: Final[Any] = _Keep()
# The names the generated functions use besides the fields (a field's own defaults and
# factories are `_default_<field>` and `_factory_<field>`, which no other field can be).
_GENERATED_NAMES: Final = frozenset(
    {"self", "record", "copy", "_cls", "_twin", "_setattr", "_new", "_NO_DEFAULT", "_KEEP"}
)
_NO_DEFAULT: Final[Any] = _Factory()


def _fields(cls: type, use: str) -> tuple[dataclasses.Field[Any], ...]:
    """The class's fields, once it is known to be a frozen slots dataclass ``use`` serves."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{use} needs a frozen slots dataclass, not {cls.__qualname__}")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{use} would skip {cls.__qualname__}.__post_init__")
    fields = dataclasses.fields(cls)
    taken = next((f.name for f in fields if f.name in _GENERATED_NAMES), None)
    if taken is not None:  # a parameter of that name would hide the generated code's own
        raise TypeError(f"{use} cannot serve {cls.__qualname__}: a field is named {taken!r}")
    return fields


def _twin(cls: type, fields: tuple[dataclasses.Field[Any], ...]) -> type | None:
    """A plain class of ``cls``'s layout, which an instance may be while it is filled (None:
    its slots are set through their descriptors)."""
    if cls.__bases__ != (object,) or len(fields) < _TWIN_FROM_FIELDS:
        return None
    namespace = {"__slots__": cls.__dict__["__slots__"], "__module__": cls.__module__}
    twin = type(cls.__name__, (), namespace)
    twin.__qualname__ = f"{cls.__qualname__}.<twin>"
    return twin


def _filling(
    cls: type, fields: tuple[dataclasses.Field[Any], ...], target: str
) -> tuple[dict[str, Any], Callable[[str, str], str], list[str], list[str]]:
    """What the generated code of ``cls`` needs: its names, the line that sets one field of
    ``target``, and the lines before and after the fields are set."""
    twin = _twin(cls, fields)
    names: dict[str, Any] = {"_cls": cls, "_setattr": object.__setattr__, "_new": object.__new__}
    if twin is not None:
        names["_twin"] = twin
        return (
            names,
            lambda name, value: f"    {target}.{name} = {value}",
            [f"    _setattr({target}, '__class__', _twin)"],
            [f"    _setattr({target}, '__class__', _cls)"],
        )
    for f in fields:
        names[f"_set_{f.name}"] = getattr(cls, f.name).__set__  # a base class's slot too
    return names, lambda name, value: f"    _set_{name}({target}, {value})", [], []


def direct_init(cls: _C) -> _C:
    """Give a frozen slots dataclass an ``__init__`` that fills its slots directly: the same
    parameters, defaults, default factories and keyword-only fields as the one
    ``@dataclass`` wrote, in a fraction of its time. Put it above the
    ``@dataclass(frozen=True, slots=True)`` line. (An instance of a subclass, which the
    twin's layout may not fit, has its fields set through ``object.__setattr__``.)"""
    fields = _fields(cls, "direct_init")
    names, assign, before, after = _filling(cls, fields, "self")
    names["_NO_DEFAULT"] = _NO_DEFAULT
    positional: list[str] = []
    keyword: list[str] = []
    values: list[tuple[str, str]] = []
    for f in fields:
        value = f.name
        if f.default_factory is not dataclasses.MISSING:
            names[f"_factory_{f.name}"] = f.default_factory
            value = f"_factory_{f.name}()"
            if f.init:
                value = f"{value} if {f.name} is _NO_DEFAULT else {f.name}"
        elif f.default is not dataclasses.MISSING:
            names[f"_default_{f.name}"] = f.default
            if not f.init:
                value = f"_default_{f.name}"
        elif not f.init:
            continue  # dataclasses leave such a field unset too
        if f.init:
            parameter = f.name
            if f.default_factory is not dataclasses.MISSING:
                parameter += "=_NO_DEFAULT"
            elif f.default is not dataclasses.MISSING:
                parameter += f"=_default_{f.name}"
            (keyword if f.kw_only else positional).append(parameter)
        values.append((f.name, value))
    parameters = ["self", *positional, *(["*", *keyword] if keyword else [])]
    lines = [f"def __init__({', '.join(parameters)}):"]
    if before:  # the twin's layout is the class's own: a subclass's may differ
        lines.append("    if self.__class__ is not _cls:")
        lines += [f"        _setattr(self, {name!r}, {value})" for name, value in values]
        lines.append("        return")
    lines += [*before, *(assign(name, value) for name, value in values), *after]
    lines.append("    pass")
    exec("\n".join(lines), names)  # the code's names are the class's own fields
    init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = dict(cls.__init__.__annotations__)  # type: ignore[misc]
    cls.__init__ = init  # type: ignore[misc]
    return cls


_COPIERS: dict[type, Callable[..., Any]] = {}


def _copier(cls: type) -> Callable[..., Any]:
    """The class's copy function, ``copy(record, **changes)``, each field kept unless
    changed; made once per class."""
    fields = _fields(cls, "evolve")
    names, assign, _, after = _filling(cls, fields, "copy")
    new = "_new(_twin)" if "_twin" in names else "_new(_cls)"
    parameters = "".join(f", {f.name}=_KEEP" for f in fields)
    body = [assign(f.name, f"record.{f.name} if {f.name} is _KEEP else {f.name}") for f in fields]
    source = (
        f"def copy(record{', *' if fields else ''}{parameters}):\n"
        f"    copy = {new}\n" + "\n".join([*body, *after, "    return copy"])
    )
    names["_KEEP"] = _KEEP
    exec(source, names)  # the code's names are the class's own fields
    copy: Callable[..., Any] = names["copy"]
    copy.__qualname__ = f"{cls.__qualname__}.<evolve>"
    _COPIERS[cls] = copy
    return copy


def evolve(record: _T, **changes: Any) -> _T:
    """``dataclasses.replace(record, **changes)`` for a frozen slots dataclass."""
    cls = type(record)
    copy = _COPIERS.get(cls) or _copier(cls)
    try:
        return copy(record, **changes)  # type: ignore[no-any-return]
    except TypeError:
        fields = getattr(record, "__dataclass_fields__", {})
        unknown = next((name for name in changes if name not in fields), None)
        if unknown is None:
            raise
        raise TypeError(f"{type(record).__qualname__} has no field {unknown!r}") from None
