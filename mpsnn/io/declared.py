"""The generic codec of the kernel classes that declare their saved fields (`mpsnn.core.saved`),
and what a two-source or gradient kernel saves of its configuration.

A declared kernel is written as the configuration its base class always saves, then one JSON
field per declared `Field`: init fields first, then the configuration, then the fields set
after construction. The configuration is, by the nearest base with one:

* `GradientKernel`: what it shares between its sources (label, options, clip rect,
  destination channel offset, padding) and ``geometry``, the per-source properties set on it by
  hand (what it reports from its last forward is not its own: a loaded kernel reports again
  after its next encode);
* `BinaryKernel`: what it shares, and each source's offset, edge mode, strides and channel
  range;
* `CNNKernel`: `mpsnn.io.kernels.enc_kernel_properties`.

Loading builds ``cls(device, **init fields)``, sets the configuration, then the other fields
(see `mpsnn.core.saved`). `mpsnn.io.codec` finds these codecs after its table: a codec
registered for a declared class replaces this one. The field helpers (`encode_field`,
`decode_field`, `set_fields_after_init`) serve the declared node classes too
(`mpsnn.io.declared_nodes`, which installs the generic codec of both).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch

from mpsnn.core.binary import BinaryKernel, GradientKernel
from mpsnn.core.cnn_kernel import CNNKernel
from mpsnn.core.geometry import EdgeMode, Offset, Region
from mpsnn.core.kernel import KernelOptions
from mpsnn.core.saved import VALUE_TUPLES, Field, saved_fields
from mpsnn.io.codec import Codec, Encoder, Fields, fail, per_class, set_declared_codec, show
from mpsnn.io.kernels import (
    dec_kernel_properties,
    decode_padding,
    decode_region,
    enc_kernel_properties,
    encode_padding,
    encode_region,
)

__all__ = [
    "dec_binary_properties",
    "dec_gradient_properties",
    "decode_declared",
    "decode_field",
    "enc_binary_properties",
    "enc_gradient_properties",
    "encode_declared",
    "encode_field",
    "kernel_codec",
    "set_fields_after_init",
]

# ---------------------------------------------------------------------------------------------
# the configuration of two-source kernels and gradient kernels

_OFFSETS = ("primary_offset", "secondary_offset")
_EDGES = ("primary_edge_mode", "secondary_edge_mode")
_BINARY_INTS = (
    "primary_stride_in_pixels_x", "primary_stride_in_pixels_y",
    "secondary_stride_in_pixels_x", "secondary_stride_in_pixels_y",
    "primary_source_feature_channel_offset", "secondary_source_feature_channel_offset",
    "primary_source_feature_channel_max_count", "secondary_source_feature_channel_max_count",
)  # fmt: skip
_GRADIENT_INTS = ("kernel_offset_x", "kernel_offset_y")
_GEOMETRY_NAMES = {*_OFFSETS, *_EDGES, *_BINARY_INTS, *_GRADIENT_INTS}


def _enc_geometry_value(name: str, value: Any) -> Any:
    if name in _OFFSETS:
        return list(value)
    if name in _EDGES:
        return EdgeMode(value).name
    return value


def _set_geometry(f: Fields, k: BinaryKernel, name: str, raw: Any, where: str) -> None:
    """Set geometry property ``name`` from its JSON (``where`` names it in errors)."""
    if name in _OFFSETS:
        ok = type(raw) is list and len(raw) == 3 and all(type(v) is int for v in raw)
        value: Any = Offset(*raw) if ok else None
        want = "a list of 3 ints"
    elif name in _EDGES:
        ok = type(raw) is str and raw in EdgeMode.__members__
        value = EdgeMode[raw] if ok else None
        want = f"one of the EdgeMode names ({', '.join(EdgeMode.__members__)})"
    else:
        ok, value, want = type(raw) is int, raw, "an int"
    if not ok:
        raise fail(f"{f.who} field {where} must be {want}, got {show(raw)}")
    setattr(k, name, value)


def _enc_shared(k: BinaryKernel) -> dict[str, Any]:
    """What a `BinaryKernel` shares between its sources (and the kernel's label, options)."""
    return {
        "label": k.label,
        "options": int(k.options),
        "clip_rect": encode_region(k.clip_rect),
        "destination_feature_channel_offset": k.destination_feature_channel_offset,
        "padding": encode_padding(k.padding, f"{type(k).__name__}.padding"),
    }


def _dec_shared(f: Fields, k: BinaryKernel) -> None:
    k.label = f.get_str("label", optional=True)
    k.options = KernelOptions(f.get_int("options", 0))
    k.clip_rect = decode_region(f, "clip_rect")
    k.destination_feature_channel_offset = f.get_int("destination_feature_channel_offset", 0)
    k.padding = decode_padding(f, "padding")


def enc_binary_properties(k: BinaryKernel) -> dict[str, Any]:
    """What every forward `BinaryKernel` can be configured with (not the allocator)."""
    out = _enc_shared(k)
    for name in (*_OFFSETS, *_EDGES, *_BINARY_INTS):
        out[name] = _enc_geometry_value(name, getattr(k, name))
    return out


def dec_binary_properties(f: Fields, k: BinaryKernel) -> None:
    _dec_shared(f, k)
    for name in (*_OFFSETS, *_EDGES, *_BINARY_INTS):
        _set_geometry(f, k, name, f.raw(name), repr(name))


def enc_gradient_properties(k: GradientKernel) -> dict[str, Any]:
    """What a `GradientKernel` shares between its sources, and ``geometry``: the properties
    set on it by hand (the others report the last forward: not the kernel's own)."""
    out = _enc_shared(k)
    out["geometry"] = {n: _enc_geometry_value(n, getattr(k, "_" + n)) for n in sorted(k._explicit)}
    return out


def dec_gradient_properties(f: Fields, k: GradientKernel) -> None:
    _dec_shared(f, k)
    raw = f.raw("geometry")
    if type(raw) is not dict or not set(raw) <= _GEOMETRY_NAMES:
        raise fail(
            f"{f.who} field 'geometry' must map some of {sorted(_GEOMETRY_NAMES)} to values, "
            f"got {show(raw)}"
        )
    for name, value in raw.items():
        _set_geometry(f, k, name, value, f"'geometry.{name}'")


# the configuration each kind of kernel saves, by base class (the nearest in the MRO wins)
_PROPERTIES: dict[type, tuple[Callable[[Any], dict[str, Any]], Callable[[Fields, Any], None]]]
_PROPERTIES = {
    GradientKernel: (enc_gradient_properties, dec_gradient_properties),
    BinaryKernel: (enc_binary_properties, dec_binary_properties),
    CNNKernel: (enc_kernel_properties, dec_kernel_properties),
}


def _properties(cls: type) -> tuple[Callable[[Any], dict[str, Any]], Callable[[Fields, Any], None]]:
    for base in cls.__mro__:
        if base in _PROPERTIES:
            return _PROPERTIES[base]
    raise TypeError(
        f"[save] {cls.__name__} declares saved fields, so it must be a CNNKernel, BinaryKernel "
        f"or GradientKernel, got the bases {[b.__name__ for b in cls.__mro__[1:]]}"
    )


# ---------------------------------------------------------------------------------------------
# the declared fields


def _want(field: Field) -> str:
    """What a field's value must be, for messages."""
    kind = field.kind
    if kind in (int, float, bool, str):
        text = {int: "an int", float: "a number", bool: "a boolean", str: "a string"}[kind]
    elif issubclass(kind, enum.Enum):
        text = f"a {kind.__name__} member"
    else:
        text = f"a {kind.__name__}"
    return text + (" or None" if field.optional else "")


def encode_field(k: Any, field: Field, enc: Encoder) -> Any:
    """The JSON of ``field`` of the object ``k`` (see `mpsnn.core.saved` for each kind)."""
    who, kind = type(k).__name__, field.kind
    try:
        v = getattr(k, field.attr)
    except AttributeError:
        raise TypeError(
            f"[save] {who} must have the attribute {field.attr!r} its saved field "
            f"{field.name!r} reads, got none at {enc.path()}"
        ) from None
    if v is None and field.optional:
        return None
    if kind is float:
        ok = type(v) in (int, float)
        out = float(v) if ok else None
    elif kind is int:
        ok = isinstance(v, int) and type(v) is not bool
        out = int(v) if ok else None
    elif kind in (bool, str):
        ok, out = type(v) is kind, v
    elif issubclass(kind, enum.Enum):
        ok = isinstance(v, kind) or (isinstance(v, int) and v in kind._value2member_map_)
        out = kind(v).name if ok else None
    elif kind is Region or kind in VALUE_TUPLES:
        ok = isinstance(v, kind)
        out = (encode_region(v) if kind is Region else list(v)) if ok else None
    elif issubclass(kind, torch.Tensor):
        ok = isinstance(v, torch.Tensor)
        out = enc.tensor(v, field.name) if ok else None
    else:
        ok = isinstance(v, kind)
        out = enc.object(v) if ok else None
    if not ok:
        raise TypeError(
            f"[save] {who} field {field.name!r} must be {_want(field)}, got "
            f"{type(v).__name__} at {enc.path()}"
        )
    return out


def decode_field(f: Fields, field: Field) -> Any:
    """The value of ``field`` (see `mpsnn.core.saved` for each kind)."""
    name, kind = field.name, field.kind
    if field.optional and f.raw(name) is None:
        return None
    if kind is int:
        return f.get_int(name, field.minimum)
    getter = {float: f.get_float, bool: f.get_bool, str: f.get_str}.get(kind)
    if getter is not None:
        return getter(name)
    if issubclass(kind, enum.Enum):
        return f.get_enum(name, kind)
    if kind is Region:
        return decode_region(f, name)
    if kind in VALUE_TUPLES:
        return kind(*f.get_ints(name, 3))
    if issubclass(kind, torch.Tensor):
        return f.get_tensor(name)
    return f.get_object(name, kind)


def encode_declared(k: Any, enc: Encoder) -> dict[str, Any]:
    """The fields of a kernel whose class declares its saved fields (see the module)."""
    fields = saved_fields(type(k)) or ()
    enc_props, _ = _properties(type(k))
    props = enc_props(k)
    clash = sorted({f.name for f in fields} & set(props))
    if clash:
        raise TypeError(
            f"[save] {type(k).__name__}'s saved field names must differ from the kernel "
            f"configuration's, got {clash}"
        )
    out = {f.name: encode_field(k, f, enc) for f in fields if f.init}
    out.update(props)
    out.update({f.name: encode_field(k, f, enc) for f in fields if not f.init})
    return out


def decode_declared(f: Fields, cls: type) -> Any:
    """A kernel of ``cls`` (which declares its saved fields) from its fields."""
    fields = saved_fields(cls) or ()
    _, dec_props = _properties(cls)
    k = cls(f.device, **{fd.name: decode_field(f, fd) for fd in fields if fd.init})
    dec_props(f, k)
    set_fields_after_init(f, k, fields)
    return k


def set_fields_after_init(f: Fields, obj: Any, fields: tuple[Field, ...]) -> None:
    """Set the ``init=False`` fields of ``fields`` on ``obj``, in order (a tensor field is
    copied into the tensor ``obj`` holds when it holds one)."""
    for fd in fields:
        if fd.init:
            continue
        held = getattr(obj, fd.attr, None)
        if issubclass(fd.kind, torch.Tensor) and isinstance(held, torch.Tensor):
            # the object keeps the tensor it made (a device counter, a buffer): filled in place
            t = f.get_tensor(fd.name, shape=held.shape, dtypes=(held.dtype,), optional=fd.optional)
            if t is None:
                setattr(obj, fd.attr, None)
            else:
                held.copy_(t)
        else:
            setattr(obj, fd.attr, decode_field(f, fd))


def kernel_codec(cls: type) -> Codec:
    """The generic codec of the kernel class ``cls`` (which declares its saved fields)."""
    return Codec(cls, cls.__name__, encode_declared, per_class(decode_declared, cls))


set_declared_codec(kernel_codec)
