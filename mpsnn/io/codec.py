"""The codec table and the objects codecs work with: `register_codec` / `registered_types`
(a kernel class that declares its saved fields, `mpsnn.core.saved`, needs no entry: the
generic codec `mpsnn.io.declared` installs with `set_declared_codec` saves it), the
`Encoder` a codec's ``encode`` writes through (objects, tensors, plain values), the `Fields`
reader a codec's ``decode`` reads from (typed getters that reject missing or
malformed fields with a `CheckpointError`), and the decoder of plain values.

Codec functions receive the encoder or the fields: only the `register_codec` call needs this
module (see `mpsnn.io` for the file format these objects fill).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from mpsnn.core.device import Device
from mpsnn.core.saved import declared_class, declared_classes
from mpsnn.errors import CheckpointError

__all__ = [
    "CODES",
    "DTYPES",
    "FLOATS",
    "NAMES",
    "Codec",
    "Decoder",
    "Encoder",
    "Fields",
    "codec_of_class",
    "codec_of_name",
    "dtype_name",
    "fail",
    "per_class",
    "register_codec",
    "registered_types",
    "set_declared_codec",
    "show",
]

# torch dtype <-> safetensors dtype code; the names in the structure are torch's.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
CODES = {code: dtype for dtype, code in DTYPES.items()}
NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPES}
FLOATS = (torch.float32, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fail(message: str) -> CheckpointError:
    return CheckpointError(f"[load] {message}")


# ---------------------------------------------------------------------------------------------
# the codec table


class Codec(NamedTuple):
    """How one class is saved and rebuilt.

    Attributes:
        cls: the class (matched exactly: a subclass needs a codec of its own).
        name: the ``type`` written in files.
        encode: ``encode(obj, encoder) -> dict`` of JSON fields; nested objects, tensors and
            values go through the `Encoder` (``encoder.object``, ``encoder.tensor``,
            ``encoder.value``).
        decode: ``decode(fields) -> obj`` from a `Fields` reader (typed getters that reject
            missing or malformed fields; ``fields.device`` is where to build).
    """

    cls: type
    name: str
    encode: Callable[[Any, Encoder], dict[str, Any]]
    decode: Callable[[Fields], Any]


_BY_CLASS: dict[type, Codec] = {}
_BY_NAME: dict[str, Codec] = {}
# The codecs of the classes that declare their saved fields, made on first use by the
# function `mpsnn.io.declared` installs (that module builds on the kernel codecs, which build
# on this one). The table above comes first: a hand-written codec overrides a declaration.
_DECLARED_CODECS: dict[type, Codec] = {}
_make_declared: list[Callable[[type], Codec]] = []


def set_declared_codec(make: Callable[[type], Codec]) -> None:
    """Install ``make(cls) -> Codec``, the generic codec of a class that declares its saved
    fields (`mpsnn.io.declared` does, at import)."""
    _make_declared[:] = [make]
    _DECLARED_CODECS.clear()


def _declared_codec(cls: type) -> Codec | None:
    """The generic codec of ``cls`` if it declares its saved fields and no codec is registered
    for it (None otherwise)."""
    codec = _DECLARED_CODECS.get(cls)
    if codec is None and _make_declared and declared_class(cls.__name__) is cls:
        if cls.__name__ in _BY_NAME:  # a hand-written codec's name: loads as that class
            raise TypeError(
                f"[save] a class saved by its declared fields must not be named like a "
                f"registered type, got {cls.__module__}.{cls.__qualname__} named "
                f"{cls.__name__!r} (registered for {_BY_NAME[cls.__name__].cls.__module__}."
                f"{_BY_NAME[cls.__name__].cls.__qualname__})"
            )
        codec = _DECLARED_CODECS[cls] = _make_declared[0](cls)
    return codec


def register_codec(
    cls: type,
    encode: Callable[[Any, Encoder], dict[str, Any]],
    decode: Callable[[Fields], Any],
    *,
    name: str | None = None,
) -> None:
    """Add ``cls`` to the codec table (see `Codec`); ``name`` defaults to ``cls.__name__``.

    A class, and a name, can be registered once. Modules that define new savable classes
    (e.g. graphs) register theirs at import; `load` knows only the types registered when it
    runs. A kernel class can instead declare its saved fields (`mpsnn.core.saved`); a codec
    registered for such a class replaces its generic one (for what a list of fields cannot
    say).

    Raises:
        TypeError: ``cls`` not a class, or ``encode``/``decode`` not callable.
        ValueError: the class or the name is registered already.
    """
    if not isinstance(cls, type):
        raise TypeError(f"[register_codec] cls must be a class, got {type(cls).__name__}")
    if not callable(encode) or not callable(decode):
        raise TypeError(
            "[register_codec] encode and decode must be callable, got "
            f"{type(encode).__name__} and {type(decode).__name__}"
        )
    key = cls.__name__ if name is None else name
    if not isinstance(key, str) or not key:
        raise TypeError(f"[register_codec] name must be a non-empty str, got {key!r}")
    if cls in _BY_CLASS:
        raise ValueError(
            f"[register_codec] a class must be registered once, got {cls.__name__} again"
        )
    if key in _BY_NAME:
        raise ValueError(
            f"[register_codec] a name must be registered once, got {key!r} again "
            f"(registered for {_BY_NAME[key].cls.__name__})"
        )
    declared = declared_class(key)
    if declared is not None and declared is not cls:
        raise ValueError(
            f"[register_codec] a name must be registered once, got {key!r}, the saved name "
            f"of {declared.__module__}.{declared.__qualname__} (it declares its saved fields)"
        )
    codec = Codec(cls, key, encode, decode)
    _BY_CLASS[cls] = codec
    _BY_NAME[key] = codec
    _DECLARED_CODECS.pop(cls, None)


def registered_types() -> dict[str, type]:
    """The types `load` knows: name written in files -> class (the codec table, then the
    classes that declare their saved fields)."""
    out = {name: codec.cls for name, codec in _BY_NAME.items()}
    if _make_declared:
        for name, cls in declared_classes().items():
            out.setdefault(name, cls)
    return out


def codec_of_name(name: Any) -> Codec | None:
    """The codec registered under ``name``, else that of the class declaring its saved fields
    under ``name`` (None: no such type)."""
    if type(name) is not str:
        return None
    codec = _BY_NAME.get(name)
    if codec is None and (cls := declared_class(name)) is not None:
        codec = _declared_codec(cls)
    return codec


def codec_of_class(cls: type) -> Codec | None:
    """The codec of exactly ``cls``: registered, else generic if ``cls`` declares its saved
    fields (None: neither)."""
    return _BY_CLASS.get(cls) or _declared_codec(cls)


def per_class(decode: Callable[[Fields, type], Any], kind: type) -> Callable[[Fields], Any]:
    """``decode(fields, kind)`` as the decode of one class (codecs shared by a family)."""
    return lambda f: decode(f, kind)


# ---------------------------------------------------------------------------------------------
# encoding


class Encoder:
    """Turns values into the JSON structure and the tensors of a file (one per `save`)."""

    def __init__(self) -> None:
        self.objects: list[dict[str, Any]] = []
        self.tensors: dict[str, torch.Tensor] = {}
        # id -> (the object, its reference): the object is kept so that its id stays unique.
        self._object_refs: dict[int, tuple[Any, dict[str, int]]] = {}
        self._tensor_refs: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        self._active: set[int] = set()  # objects and containers being encoded (cycles)
        self._where: list[str] = ["root"]
        #: scratch space of the codecs for one save (e.g. what the graph codecs learn once
        #: about the training graphs of everything saved): keys are the codecs' own names.
        self.context: dict[str, Any] = {}

    def value(self, v: Any) -> Any:
        """A plain value (None, bool, int, float, str, list, tuple, dict with str keys,
        tensor, or an object of a registered type) as JSON."""
        t = type(v)
        if v is None or t is bool or t is int or t is str:
            return v
        if t is float:
            return _float_json(v)
        if isinstance(v, torch.Tensor):
            return self.tensor(v, "tensor")
        if t in (list, tuple, dict):
            if id(v) in self._active:
                raise ValueError(
                    f"[save] values must not contain themselves, got a {t.__name__} inside "
                    f"itself at {self.path()}"
                )
            self._active.add(id(v))
            try:
                if t is dict:
                    out = {}
                    for key, item in v.items():
                        if type(key) is not str:
                            raise TypeError(
                                f"[save] dict keys must be str, got {type(key).__name__} "
                                f"{key!r} at {self.path()}"
                            )
                        self._where.append(key)
                        out[key] = self.value(item)
                        self._where.pop()
                    return {"$dict": out}
                items = []
                for i, item in enumerate(v):
                    self._where.append(str(i))
                    items.append(self.value(item))
                    self._where.pop()
                return items if t is list else {"$tuple": items}
            finally:
                self._active.discard(id(v))
        if codec_of_class(t) is not None or isinstance(
            v, (*_BY_CLASS, *declared_classes().values())
        ):  # (the tuple only where no codec is found: a subclass, refused by `object`)
            return self.object(v)
        raise TypeError(
            f"[save] values must be None, bool, int, float, str, list, tuple, dict, tensors or "
            f"objects of a registered type ({', '.join(sorted(_BY_NAME))}), got "
            f"{t.__name__} at {self.path()}"
        )

    def object(self, obj: Any) -> dict[str, int] | None:
        """A reference to ``obj`` (None for None), encoding it the first time it is seen."""
        if obj is None:
            return None
        known = self._object_refs.get(id(obj))
        if known is not None:
            return known[1]
        codec = codec_of_class(type(obj))
        if codec is None:
            raise TypeError(
                f"[save] objects must be of a registered type (see mpsnn.io.register_codec), "
                f"got {type(obj).__name__} at {self.path()}"
            )
        if id(obj) in self._active:
            raise ValueError(
                f"[save] objects must not reference themselves, got a cycle through "
                f"{codec.name} at {self.path()}"
            )
        self._active.add(id(obj))
        self._where.append(codec.name)
        try:
            fields = _json_fields(codec.encode(obj, self), codec.name)
        finally:
            self._where.pop()
            self._active.discard(id(obj))
        self.objects.append({"type": codec.name, "fields": fields})
        ref = {"$obj": len(self.objects) - 1}
        self._object_refs[id(obj)] = (obj, ref)
        return ref

    def tensor(self, t: torch.Tensor | None, name: str = "tensor") -> dict[str, Any] | None:
        """A reference to ``t`` (None for None), whose values `save` writes once every object
        is encoded; ``name`` becomes part of the tensor's name in the file. The same tensor
        object saved twice is stored once and loads as one tensor."""
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"[save] {name} must be a tensor, got {type(t).__name__}")
        known = self._tensor_refs.get(id(t))
        if known is not None:
            return known[1]
        if t.layout != torch.strided:
            raise TypeError(
                f"[save] tensors must be dense (strided), got {t.layout} at {self.path()}.{name}"
            )
        if t.dtype not in DTYPES:
            raise TypeError(
                f"[save] tensors must have one of the dtypes "
                f"{', '.join(dtype_name(d) for d in DTYPES)}, got {dtype_name(t.dtype)} "
                f"at {self.path()}.{name}"
            )
        key = f"{len(self.tensors)}.{self._where[-1]}.{name}"
        # not copied: the file is written from the tensor's memory right after encoding
        self.tensors[key] = t.detach()
        ref = {"$tensor": key, "dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        self._tensor_refs[id(t)] = (t, ref)
        return ref

    def path(self) -> str:
        """Where the encoder is in the saved value (``root.layers.0.Convolution``), for
        messages."""
        return ".".join(self._where)


def _float_json(v: float) -> Any:
    """A float as JSON: itself when finite, else a ``$float`` tag."""
    if math.isfinite(v):
        return v
    return {"$float": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}


def _json_fields(fields: Any, who: str) -> dict[str, Any]:
    """A codec's fields, checked to be JSON (non-finite floats tagged)."""

    def walk(v: Any) -> Any:
        if v is None or type(v) in (bool, int, str):
            return v
        if type(v) is float:
            return _float_json(v)
        if type(v) in (list, tuple):
            return [walk(x) for x in v]
        if type(v) is dict and all(type(k) is str for k in v):
            return {k: walk(x) for k, x in v.items()}
        raise TypeError(
            f"[save] the {who} codec must return JSON fields (encode nested values with the "
            f"Encoder), got {type(v).__name__}"
        )

    if type(fields) is not dict:
        raise TypeError(
            f"[save] the {who} codec must return a dict of fields, got {type(fields).__name__}"
        )
    return walk(fields)


# ---------------------------------------------------------------------------------------------
# decoding


class Decoder:
    """Rebuilds values from a checked structure and the file's tensors (one per `load`)."""

    def __init__(
        self,
        read: Callable[[str], torch.Tensor],
        device: Device,
        uses: dict[str, int] | None = None,
    ) -> None:
        self.device = device
        self._read = read  # a tensor of the file: a new CPU tensor owning its memory
        self._tensors: dict[str, torch.Tensor] = {}
        # references left per tensor: a tensor is kept for its later references only, so
        # that a codec converting it (a layout, a dtype) does not hold the file's copy too
        self._uses = dict(uses) if uses is not None else None
        self.objects: list[Any] = []

    def tensor(self, ref: Any, where: str) -> torch.Tensor:
        if not (isinstance(ref, dict) and "$tensor" in ref):
            raise fail(f"{where} must be a tensor reference, got {show(ref)}")
        name = ref["$tensor"]
        t = self._tensors.get(name)
        if t is None:
            t = self._read(name).to(self.device.torch_device)  # never copied on the cpu
        if self._uses is None:
            self._tensors[name] = t
        else:
            left = self._uses.get(name, 1) - 1
            self._uses[name] = left
            if left > 0:
                self._tensors[name] = t
            else:
                self._tensors.pop(name, None)
        return t

    def object(self, ref: Any, where: str) -> Any:
        if not (isinstance(ref, dict) and "$obj" in ref):
            raise fail(f"{where} must be an object reference, got {show(ref)}")
        return self.objects[ref["$obj"]]

    def value(self, v: Any, where: str) -> Any:
        if v is None or type(v) in (bool, int, float, str):
            return v
        if type(v) is list:
            return [self.value(x, f"{where}.{i}") for i, x in enumerate(v)]
        if type(v) is dict:
            if "$tensor" in v:
                return self.tensor(v, where)
            if "$obj" in v:
                return self.object(v, where)
            if set(v) == {"$dict"} and type(v["$dict"]) is dict:
                return {k: self.value(x, f"{where}.{k}") for k, x in v["$dict"].items()}
            if set(v) == {"$tuple"} and type(v["$tuple"]) is list:
                return tuple(self.value(x, f"{where}.{i}") for i, x in enumerate(v["$tuple"]))
            if set(v) == {"$float"} and v["$float"] in ("nan", "inf", "-inf"):
                return float(v["$float"])
        raise fail(
            f"{where} must be null, a boolean, a number, a string, a list or a tagged object "
            f"($obj, $tensor, $dict, $tuple, $float), got {show(v)}"
        )


def show(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


class Fields:
    """An object's fields, read by its codec's ``decode``: typed getters that raise
    `CheckpointError` for a missing or malformed field. Fields left unread are rejected
    after ``decode`` returns. ``device`` is the `Device` to build on."""

    def __init__(self, decoder: Decoder, who: str, data: dict[str, Any]) -> None:
        self._decoder = decoder
        self.who = who
        self.device: Device = decoder.device
        self._data = data
        self._read: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._data

    def raw(self, name: str) -> Any:
        """The field's JSON, as stored."""
        if name not in self._data:
            raise fail(
                f"{self.who} must have the field {name!r}, got the fields {sorted(self._data)}"
            )
        self._read.add(name)
        return self._data[name]

    def _bad(self, name: str, want: str, got: Any) -> CheckpointError:
        return fail(f"{self.who} field {name!r} must be {want}, got {show(got)}")

    def get_bool(self, name: str) -> bool:
        v = self.raw(name)
        if type(v) is not bool:
            raise self._bad(name, "a boolean", v)
        return v

    def get_int(self, name: str, minimum: int | None = None, *, optional: bool = False) -> Any:
        v = self.raw(name)
        if v is None and optional:
            return None
        if type(v) is not int or (minimum is not None and v < minimum):
            want = "an int" + ("" if minimum is None else f" >= {minimum}")
            raise self._bad(name, want + (" or null" if optional else ""), v)
        return v

    def get_ints(self, name: str, count: int) -> list[int]:
        v = self.raw(name)
        if type(v) is not list or len(v) != count or any(type(x) is not int for x in v):
            raise self._bad(name, f"a list of {count} ints", v)
        return v

    def get_number_rows(self, name: str, columns: tuple[str, ...]) -> list[tuple[float, ...]]:
        """A non-empty list of rows of ``len(columns)`` numbers (``columns`` names them in the
        message), as tuples of floats."""
        v = self.raw(name)
        n = len(columns)
        if (
            type(v) is not list
            or not v
            or any(type(r) is not list or len(r) != n for r in v)
            or any(type(x) not in (int, float) for r in v for x in r)
        ):
            raise self._bad(name, f"a non-empty list of [{', '.join(columns)}] numbers", v)
        return [tuple(map(float, r)) for r in v]

    def get_float(self, name: str) -> float:
        v = self.raw(name)
        if type(v) in (int, float):
            return float(v)
        if type(v) is dict and set(v) == {"$float"} and v["$float"] in ("nan", "inf", "-inf"):
            return float(v["$float"])
        raise self._bad(name, "a number", v)

    def get_str(self, name: str, *, optional: bool = False) -> Any:
        v = self.raw(name)
        if type(v) is str or (v is None and optional):
            return v
        raise self._bad(name, "a string" + (" or null" if optional else ""), v)

    def get_enum(self, name: str, kind: type) -> Any:
        v = self.raw(name)
        members = kind.__members__  # type: ignore[attr-defined]
        if type(v) is not str or v not in members:
            raise self._bad(name, f"one of the {kind.__name__} names ({', '.join(members)})", v)
        return members[v]

    def get_object(
        self, name: str, kind: type | tuple[type, ...], *, optional: bool = False
    ) -> Any:
        v = self.raw(name)
        if v is None and optional:
            return None
        if not (type(v) is dict and "$obj" in v):
            raise self._bad(name, "an object reference" + (" or null" if optional else ""), v)
        return self.resolve_object(v, repr(name), kind)

    def resolve_object(self, ref: Any, where: str, kind: type | tuple[type, ...]) -> Any:
        """An object reference found inside a field (``where`` names it in errors), checked to
        be an instance of ``kind``."""
        obj = self._decoder.object(ref, f"{self.who} field {where}")
        if not isinstance(obj, kind):
            names = (
                kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            )
            raise fail(
                f"{self.who} field {where} must be an instance of {names}, got {type(obj).__name__}"
            )
        return obj

    def get_value(self, name: str) -> Any:
        """A plain value (see `Encoder.value`)."""
        return self.resolve_value(self.raw(name), repr(name))

    def resolve_value(self, raw: Any, where: str) -> Any:
        """A plain value found inside a field (``where`` names it in errors)."""
        return self._decoder.value(raw, f"{self.who} field {where}")

    def get_tensor(
        self,
        name: str,
        *,
        shape: Sequence[int] | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
        optional: bool = False,
    ) -> Any:
        """The field's tensor, on ``device`` (None for null when ``optional``)."""
        v = self.raw(name)
        if v is None and optional:
            return None
        return self.resolve_tensor(v, repr(name), shape=shape, dtypes=dtypes)

    def resolve_tensor(
        self,
        ref: Any,
        where: str,
        *,
        shape: Sequence[int] | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
    ) -> torch.Tensor:
        """A tensor reference found inside a field (``where`` names it in errors), checked."""
        t = self._decoder.tensor(ref, f"{self.who} field {where}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise fail(
                f"{self.who} field {where} must have the shape {list(shape)}, got {list(t.shape)}"
            )
        if dtypes is not None and t.dtype not in dtypes:
            raise fail(
                f"{self.who} field {where} must have the dtype "
                f"{' or '.join(dtype_name(d) for d in dtypes)}, got {dtype_name(t.dtype)}"
            )
        return t

    def _finish(self) -> None:
        extra = sorted(set(self._data) - self._read)
        if extra:
            raise fail(f"{self.who} must have only the fields its type reads, got also {extra}")
