"""The forward → gradient registry, in both directions.

Every gradient kernel class names its forward kernel class once, with `gradient_of`; the
registry answers "which gradient kernels differentiate this forward kernel" (the training
graph walks it) and "which forward kernel does this gradient kernel differentiate" (gradient
kernels check their state against it). Subclasses of a registered forward class find its
gradients through their method resolution order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["forward_kernel_of", "gradient_kernels_of", "gradient_of", "registered_pairs"]

_GRADIENTS: dict[type, list[type]] = {}
_FORWARD: dict[type, type] = {}

T = TypeVar("T", bound=type)


def gradient_of(forward_class: type) -> Callable[[T], T]:
    """Class decorator: the decorated gradient kernel differentiates ``forward_class``."""

    def register(gradient_class: T) -> T:
        gradient_class._forward_class = forward_class  # type: ignore[attr-defined]
        _FORWARD[gradient_class] = forward_class
        _GRADIENTS.setdefault(forward_class, []).append(gradient_class)
        return gradient_class

    return register


def gradient_kernels_of(forward_class: type) -> tuple[type, ...]:
    """The gradient kernel classes of ``forward_class`` (or of its nearest registered base)."""
    for cls in forward_class.__mro__:
        if cls in _GRADIENTS:
            return tuple(_GRADIENTS[cls])
    return ()


def forward_kernel_of(gradient_class: type) -> type | None:
    """The forward kernel class ``gradient_class`` differentiates (None if unregistered)."""
    for cls in gradient_class.__mro__:
        if cls in _FORWARD:
            return _FORWARD[cls]
    return None


def registered_pairs() -> list[tuple[type, type]]:
    """Every ``(forward class, gradient class)`` pair, in registration order."""
    return [(f, g) for g, f in _FORWARD.items()]
