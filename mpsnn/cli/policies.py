"""``--padding`` of ``mpsnn check``: words for the MPS padding policies (`DefaultPadding`)."""

from __future__ import annotations

from typing import Any

from mpsnn.core.geometry import DefaultPadding, PaddingMethod

__all__ = ["PADDING_HELP", "describe_padding", "padding_policy"]

_P = PaddingMethod
_ALIGN, _REMAINDER = 0x3, 0xC  # the alignment and remainder fields
_SIZES = {"valid": _P.SIZE_VALID_ONLY, "same": _P.SIZE_SAME, "full": _P.SIZE_FULL}
_WORDS = {  # word -> (field mask, value)
    "centered": (_ALIGN, _P.ALIGN_CENTERED),
    "top-left": (_ALIGN, _P.ALIGN_TOP_LEFT),
    "bottom-right": (_ALIGN, _P.ALIGN_BOTTOM_RIGHT),
    "remainder-top-left": (_REMAINDER, _P.ADD_REMAINDER_TO_TOP_LEFT),
    "remainder-top-right": (_REMAINDER, _P.ADD_REMAINDER_TO_TOP_RIGHT),
    "remainder-bottom-left": (_REMAINDER, _P.ADD_REMAINDER_TO_BOTTOM_LEFT),
    "remainder-bottom-right": (_REMAINDER, _P.ADD_REMAINDER_TO_BOTTOM_RIGHT),
    "exclude-edges": (int(_P.EXCLUDE_EDGES), _P.EXCLUDE_EDGES),
}
PADDING_HELP = (
    "valid|same|full, then optional comma-separated words: "
    + "|".join(_WORDS)
    + "; or tf-average-pooling, tf-average-pooling-valid"
)


def padding_policy(spec: str) -> DefaultPadding:
    """``same,top-left,exclude-edges`` -> DefaultPadding; ValueError naming the valid words."""
    if spec == "tf-average-pooling":
        return DefaultPadding.tensorflow_average_pooling()
    if spec == "tf-average-pooling-valid":
        return DefaultPadding.tensorflow_average_pooling_valid_only()
    first, *rest = spec.split(",")
    if first not in _SIZES:
        raise ValueError(f"expected {PADDING_HELP}; got {spec!r}")
    method = int(_SIZES[first])
    for word in rest:
        if word not in _WORDS:
            raise ValueError(f"unknown word {word!r}; expected {PADDING_HELP}")
        mask, value = _WORDS[word]
        method = (method & ~mask) | int(value)
    return DefaultPadding(_P(method))


def describe_padding(policy: Any) -> str:
    """The policy's method as its PaddingMethod names (and the policy's label)."""
    method = int(policy.padding_method)
    names = [
        ("ALIGN_CENTERED", "ALIGN_TOP_LEFT", "ALIGN_BOTTOM_RIGHT", "ALIGN_RESERVED")[method & 3],
        ("ADD_REMAINDER_TO_TOP_LEFT", "ADD_REMAINDER_TO_TOP_RIGHT",
         "ADD_REMAINDER_TO_BOTTOM_LEFT", "ADD_REMAINDER_TO_BOTTOM_RIGHT")[(method >> 2) & 3],
        {0: "SIZE_VALID_ONLY", 16: "SIZE_SAME", 32: "SIZE_FULL"}.get(method & 0x7F0, "?"),
    ]  # fmt: skip
    names += [f.name for f in (_P.CUSTOM, _P.EXCLUDE_EDGES) if method & f]
    label = getattr(policy, "label", None)
    return " | ".join(names) + (f" ({label})" if label else "")
