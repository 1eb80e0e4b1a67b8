"""What a kernel or filter node class saves, declared next to its definition: `Field` and the
registry of the classes that declare their fields.

A kernel class declares its saved fields with a class attribute of its own body::

    class PoolingMax(_Pooling):
        saved_fields = (Field("kernel_width", int, minimum=1), ...)

`Kernel.__init_subclass__` records every class whose own body sets ``saved_fields`` (a
subclass that only inherits them is not recorded: like a class saved by a hand-written codec,
it must say what it saves); `mpsnn.io` then saves and loads it with one generic codec, under
the class's ``__name__``, with no codec of its own. ``saved_fields = ()`` declares a kernel
that saves only its kernel configuration.

A forward filter node class declares its saved fields the same way, in its family's module
(`FilterNode.__init_subclass__` records it; a gradient node may not: it is saved as its place
in a training graph): what every filter node saves, its source first, comes with them (see
`mpsnn.io.declared_nodes`), and loading calls ``cls(source, **init fields)``.

What a declared kernel is in a file: the kernel configuration its base class always saves
(a one-source kernel's label, options, offset, clip rect, edge mode, feature channel range and
padding; a two-source or gradient kernel's per-source ones), then one JSON field per `Field`,
named ``Field.name``. Loading calls ``cls(device, **{f.name: value for the init fields})``
(so each init field names a parameter of the constructor), sets the kernel configuration, then
sets each field with ``init=False`` as an attribute, in the order declared.

Supported kinds and how each is saved:

* ``int``, ``float``, ``bool``, ``str``: the JSON value (an ``int`` field may have a
  ``minimum``; a float may be infinite or NaN).
* an `enum.Enum` class: the member's name.
* `Size`, `Offset`, `Origin`: a list of their three ints; `Region`: ``[x, y, z, width,
  height, depth]``.
* ``torch.Tensor``: a tensor of the file. An init field passes it to the constructor; a
  field with ``init=False`` is copied into the tensor the constructor made (the saved one must
  have its shape and dtype), so a kernel keeps the device tensor it holds.
* any other class: an object of a savable type, saved as a reference (an object saved twice
  is one object again after loading); loading checks it is an instance of the class.

``optional=True`` lets a field be None (saved as ``null``). ``attr`` names the attribute read
at save (and set at load, for ``init=False``) when it is not the field's name (a constructor
argument kept privately).
"""

from __future__ import annotations

import inspect
import keyword
from dataclasses import dataclass
from typing import Any

from mpsnn.core.geometry import Offset, Origin, Size

__all__ = [
    "VALUE_TUPLES",
    "Field",
    "declare_saved_fields",
    "declared_class",
    "declared_classes",
    "record_saved_class",
    "same_definition",
    "saved_fields",
]

#: kinds saved as a list of ints: the value's fields in order
VALUE_TUPLES: tuple[type, ...] = (Size, Offset, Origin)
# classes that hold values (a container) or nothing savable: never an object reference
_UNSUPPORTED: tuple[type, ...] = (
    list, tuple, dict, set, frozenset, bytes, bytearray, complex, object, type, type(None),
)  # fmt: skip

_KINDS = "int, float, bool, str, an Enum class, Size, Offset, Origin, Region, torch.Tensor or a "
_KINDS += "savable class"


def _check_identifier(who: str, what: str, value: Any) -> str:
    if type(value) is not str or not value.isidentifier() or keyword.iskeyword(value):
        raise ValueError(f"[{who}] {what} must be a Python identifier, got {value!r}")
    return value


@dataclass(frozen=True)
class Field:
    """One saved field of a kernel class (see the module for the kinds and the loading order).

    Attributes:
        name: the JSON key; for an init field, also the constructor's keyword.
        kind: what the value is (see the module).
        init: whether the value is a constructor argument (else set as an attribute after).
        optional: whether the value may be None (saved as ``null``).
        minimum: the least value an ``int`` field loads (None: any int).
        attr: the attribute holding the value (default: ``name``).
    """

    name: str
    kind: type
    init: bool = True
    optional: bool = False
    minimum: int | None = None
    attr: str = ""

    def __post_init__(self) -> None:
        _check_identifier("Field", "name", self.name)
        if not isinstance(self.kind, type):
            raise TypeError(
                f"[Field] kind must be a class ({_KINDS}), got {type(self.kind).__name__} "
                f"{self.kind!r} for {self.name!r}"
            )
        if self.kind in _UNSUPPORTED:
            raise ValueError(
                f"[Field] kind must be {_KINDS}, got {self.kind.__name__} for {self.name!r}"
            )
        for flag in ("init", "optional"):
            if type(getattr(self, flag)) is not bool:
                raise TypeError(
                    f"[Field] {flag} must be a bool, got {type(getattr(self, flag)).__name__}"
                )
        if self.minimum is not None and (self.kind is not int or type(self.minimum) is not int):
            raise ValueError(
                f"[Field] minimum must be an int, for an int field only, got {self.minimum!r} "
                f"for the {self.kind.__name__} field {self.name!r}"
            )
        if self.attr:
            _check_identifier("Field", "attr", self.attr)
        else:
            object.__setattr__(self, "attr", self.name)


_DECLARED: dict[str, type] = {}
_AMBIGUOUS: set[str] = set()  # names `record_saved_class` found on two classes
_RECORDED: set[str] = set()  # names `record_saved_class` recorded (no declaration)


def saved_fields(cls: type) -> tuple[Field, ...] | None:
    """The fields ``cls`` declares in its own body (None: it declares none)."""
    fields = cls.__dict__.get("saved_fields")
    return None if fields is None else tuple(fields)


def declare_saved_fields(cls: type, reserved: tuple[str, ...] = ()) -> None:
    """Check the ``saved_fields`` of ``cls``'s own body and record ``cls`` under its name
    (`Kernel.__init_subclass__` and `FilterNode.__init_subclass__` call this for every class
    that sets them). ``reserved``: the names the base's saved form takes already (a filter
    node's source and common attributes), which no field may take.

    Raises:
        TypeError: ``saved_fields`` not a tuple of `Field`.
        ValueError: two fields of one name, or a reserved one; an init field that the
            constructor takes no keyword for; an ``init=False`` field whose attribute is a
            read-only property; another class recorded under the same name (a class defined
            again, same module and qualified name, replaces its earlier definition).
    """
    who = cls.__name__
    fields = cls.__dict__["saved_fields"]
    if type(fields) is not tuple or not all(isinstance(f, Field) for f in fields):
        raise TypeError(
            f"[{who}] saved_fields must be a tuple of Field, got {type(fields).__name__}"
            + ("" if type(fields) is not tuple else " holding other values")
        )
    names = [f.name for f in fields]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"[{who}] saved field names must be distinct, got {twice} twice")
    taken = [n for n in names if n in reserved]
    if taken:
        raise ValueError(
            f"[{who}] saved field names must not be those its base class saves already "
            f"({', '.join(reserved)}), got {taken}"
        )
    params = inspect.signature(cls).parameters  # the constructor's, without self
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    keywords = {
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    for f in fields:
        if f.init and not takes_any and f.name not in keywords:
            raise ValueError(
                f"[{who}] the init field {f.name!r} must name a parameter of {who}.__init__ "
                f"(or be declared with init=False), got the parameters "
                f"({', '.join(params)})"
            )
        prop = inspect.getattr_static(cls, f.attr, None)
        if not f.init and isinstance(prop, property) and prop.fset is None:
            raise ValueError(
                f"[{who}] the field {f.name!r} (init=False) must be settable after "
                f"construction, got the read-only property {f.attr!r}"
            )
    _check_one_class(cls, who in _AMBIGUOUS)
    _DECLARED[who] = cls
    _RECORDED.discard(who)


def same_definition(a: type, b: type) -> bool:
    """One class, or one defined again (the same module and qualified name: a module or
    notebook cell run twice), which a registry by name replaces instead of refusing."""
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def _check_one_class(cls: type, ambiguous: bool) -> None:
    """Raise unless ``cls``'s name is free for it: not declared by another class, and not a
    name `record_saved_class` found on two classes."""
    who = cls.__name__
    known = _DECLARED.get(who)
    if ambiguous or (known is not None and not same_definition(known, cls)):
        other = (
            "two gradient node classes"
            if known is None
            else (f"{known.__module__}.{known.__qualname__}")
        )
        raise ValueError(
            f"[{who}] a saved name must be declared by one class, got {who!r} again "
            f"(declared by {other})"
        )


def record_saved_class(cls: type) -> None:
    """Record ``cls`` under its name with no fields of its own: a class whose saved form a
    base's codec defines for every subclass (a graph's gradient nodes, saved as their place in
    a training graph), so that a file can name it. A private name (a leading underscore: a base
    never saved) is not recorded. Two recorded classes of one name (a module and qualified name
    apart) are neither found by that name: a file could not tell them apart (register a codec
    under another name for one of them).

    Raises:
        ValueError: a class that declares its saved fields has the name already.
    """
    who = cls.__name__
    if who.startswith("_") or who in _AMBIGUOUS:
        return
    known = _DECLARED.get(who)
    if known is None or same_definition(known, cls):
        _DECLARED[who] = cls
        _RECORDED.add(who)
        return
    if who not in _RECORDED:  # a declared class's name: one class per saved name
        _check_one_class(cls, False)
    del _DECLARED[who]
    _RECORDED.discard(who)
    _AMBIGUOUS.add(who)


def declared_class(name: str) -> type | None:
    """The class that declares its saved fields under ``name`` (None: none does)."""
    return _DECLARED.get(name)


def declared_classes() -> dict[str, type]:
    """Every class that declares its saved fields: name -> class."""
    return dict(_DECLARED)
