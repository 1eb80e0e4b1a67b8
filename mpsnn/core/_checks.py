"""Small validation helpers shared by the kernel bases and the families.

Each raises `TypeError` or `ValueError` with the ``[ClassName] what must hold, got what`` shape.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["check_enum", "check_int", "check_positive", "check_type"]


def check_type(who: str, name: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__
        raise TypeError(f"[{who}] {name} must be a {names}, got {type(value).__name__}")
    return value


def check_int(who: str, name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"[{who}] {name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"[{who}] {name} must be >= {minimum}, got {value}")
    return value


def check_positive(who: str, name: str, value: Any) -> int:
    check_int(who, name, value)
    if value < 1:
        raise ValueError(f"[{who}] {name} must be positive, got {value}")
    return value


def check_enum(
    who: str, name: str, value: Any, enum_type: type[enum.Enum], allowed: Any = None
) -> Any:
    if not isinstance(value, enum_type):
        raise TypeError(
            f"[{who}] {name} must be a {enum_type.__name__}, got {type(value).__name__} {value!r}"
        )
    if allowed is not None and value not in allowed:
        names = ", ".join(a.name for a in allowed)
        raise ValueError(f"[{who}] {name} must be one of {names}, got {value.name}")
    return value
