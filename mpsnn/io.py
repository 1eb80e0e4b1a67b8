"""Saving and loading mpsnn objects (the role of MPS's ``NSSecureCoding``): `save`, `load`, and
the codec table that says how each class is written and rebuilt.

File format (version 1)
-----------------------

One safetensors file. Its tensors hold every tensor of the saved objects (CPU, contiguous,
in their own dtype); its header's ``__metadata__`` map holds one key, ``"mpsnn"``, whose
value is a JSON document::

    {"format": "mpsnn", "version": 1, "root": <value>, "objects": [<object>, ...]}

* ``<object>`` is ``{"type": <registered name>, "fields": {...}}``; what the fields are is the
  business of the type's codec (`register_codec`). An object referenced several times is
  written once and comes back as one object (a kernel and the checkpoint both referencing a
  data source, two data sources sharing an optimizer). An object's fields reference only
  objects earlier in the table; every object is referenced.
* ``<value>`` is JSON ``null``, a boolean, an int, a finite float, a string or a list
  (a Python list), or a tagged JSON object with one tag: ``{"$obj": i}`` (object ``i`` of the
  table), ``{"$tensor": name, "dtype": "float32", "shape": [...]}`` (a tensor of the file),
  ``{"$dict": {...}}`` (a dict with str keys), ``{"$tuple": [...]}``, ``{"$float": "nan" |
  "inf" | "-inf"}``.

Guarantees
----------

* Loading never executes code: no pickle, no eval, no import by name. A type is resolved
  through the codec table only; an unknown type is rejected.
* A file is checked before anything is built: the safetensors header (length, JSON, entries,
  the tensor data's extent: a truncated file is rejected), the ``"mpsnn"`` document (format,
  version, keys), every tensor reference (present, with the dtype and shape the structure
  states), no tensor the structure does not reference. Codecs then check what their class
  needs (shapes against descriptors, dtypes against the parameters). Every rejection is a
  `CheckpointError` (a `ValueError`) reading ``[load] what must hold, got what``.
* Writes are atomic: the file is written to a temporary file in the target's directory
  (``.<name>.<random>.tmp``), flushed, fsynced, and renamed onto the target (then the
  directory is fsynced where the platform allows). A save that raises removes its temporary
  file; a process killed mid-save leaves the previous file intact (and possibly a stray
  temporary file, never read by `load`).
* `load` restores values bit for bit, on the device asked for: weights, optimizer state
  vectors, the optimizers' hyperparameter tensors and Adam's step, dropout counters.

`save` reads tensors on the current stream: wait for committed command buffers first.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import safetensors.torch
import torch

from mpsnn.cnn.convolution.data_source import ConvolutionDataSource, TensorConvolutionDataSource
from mpsnn.cnn.convolution.descriptor import (
    ConvolutionAccumulatorPrecisionOption,
    ConvolutionDescriptor,
)
from mpsnn.cnn.convolution.kernels import Convolution, ConvolutionTranspose, FullyConnected
from mpsnn.cnn.dropout import Dropout
from mpsnn.cnn.loss import Loss, LossDescriptor, LossType, ReductionType
from mpsnn.cnn.neuron import Neuron
from mpsnn.cnn.neuron_descriptor import NeuronDescriptor, NeuronType
from mpsnn.cnn.normalization.batch_norm import BatchNormalization
from mpsnn.cnn.normalization.data_sources import (
    BatchNormalizationDataSource,
    GroupNormalizationDataSource,
    InstanceNormalizationDataSource,
    TensorBatchNormalizationDataSource,
    TensorGroupNormalizationDataSource,
    TensorInstanceNormalizationDataSource,
)
from mpsnn.cnn.normalization.group_norm import GroupNormalization, InstanceNormalization
from mpsnn.cnn.pooling import DilatedPoolingMax, PoolingAverage, PoolingL2Norm, PoolingMax
from mpsnn.cnn.softmax import LogSoftMax, SoftMax
from mpsnn.core.cnn_kernel import CNNKernel
from mpsnn.core.device import Device
from mpsnn.core.geometry import (
    DefaultPadding,
    EdgeMode,
    Offset,
    Origin,
    PaddingMethod,
    Region,
    Size,
)
from mpsnn.core.kernel import KernelOptions, TrainingStyle
from mpsnn.errors import CheckpointError
from mpsnn.ops.optim import RegularizationType
from mpsnn.optim.optimizers import SGD, Adam, Optimizer, OptimizerDescriptor, RMSProp

__all__ = [
    "FORMAT",
    "METADATA_KEY",
    "VERSION",
    "CheckpointError",
    "Codec",
    "Encoder",
    "Fields",
    "load",
    "register_codec",
    "registered_types",
    "save",
]

FORMAT = "mpsnn"
VERSION = 1
METADATA_KEY = "mpsnn"

# torch dtype <-> safetensors dtype code; the names in the structure are torch's.
_DTYPES: dict[torch.dtype, str] = {
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
_CODES = {code: dtype for dtype, code in _DTYPES.items()}
_NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in _DTYPES}
_FLOATS = (torch.float32, torch.float64)
_MAX_HEADER = 100_000_000  # safetensors' own limit


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fail(message: str) -> CheckpointError:
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
    runs.

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
    codec = Codec(cls, key, encode, decode)
    _BY_CLASS[cls] = codec
    _BY_NAME[key] = codec


def registered_types() -> dict[str, type]:
    """The codec table: name written in files -> class."""
    return {name: codec.cls for name, codec in _BY_NAME.items()}


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
                    f"itself at {self._path()}"
                )
            self._active.add(id(v))
            try:
                if t is dict:
                    out = {}
                    for key, item in v.items():
                        if type(key) is not str:
                            raise TypeError(
                                f"[save] dict keys must be str, got {type(key).__name__} "
                                f"{key!r} at {self._path()}"
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
        if t in _BY_CLASS or isinstance(v, tuple(_BY_CLASS)):
            return self.object(v)  # a subclass of a registered class is refused there
        raise TypeError(
            f"[save] values must be None, bool, int, float, str, list, tuple, dict, tensors or "
            f"objects of a registered type ({', '.join(sorted(_BY_NAME))}), got "
            f"{t.__name__} at {self._path()}"
        )

    def object(self, obj: Any) -> dict[str, int] | None:
        """A reference to ``obj`` (None for None), encoding it the first time it is seen."""
        if obj is None:
            return None
        known = self._object_refs.get(id(obj))
        if known is not None:
            return known[1]
        codec = _BY_CLASS.get(type(obj))
        if codec is None:
            raise TypeError(
                f"[save] objects must be of a registered type (see mpsnn.io.register_codec), "
                f"got {type(obj).__name__} at {self._path()}"
            )
        if id(obj) in self._active:
            raise ValueError(
                f"[save] objects must not reference themselves, got a cycle through "
                f"{codec.name} at {self._path()}"
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
        """A reference to a copy of ``t`` (None for None); ``name`` becomes part of the
        tensor's name in the file. The same tensor object saved twice is stored once and
        loads as one tensor."""
        if t is None:
            return None
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"[save] {name} must be a tensor, got {type(t).__name__}")
        known = self._tensor_refs.get(id(t))
        if known is not None:
            return known[1]
        if t.layout != torch.strided:
            raise TypeError(
                f"[save] tensors must be dense (strided), got {t.layout} at {self._path()}.{name}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"[save] tensors must have one of the dtypes "
                f"{', '.join(_dtype_name(d) for d in _DTYPES)}, got {_dtype_name(t.dtype)} "
                f"at {self._path()}.{name}"
            )
        key = f"{len(self.tensors)}.{self._where[-1]}.{name}"
        copy = torch.empty(tuple(t.shape), dtype=t.dtype)
        copy.copy_(t.detach())  # CPU, contiguous, owning its memory (nothing shared)
        self.tensors[key] = copy
        ref = {"$tensor": key, "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
        self._tensor_refs[id(t)] = (t, ref)
        return ref

    def _path(self) -> str:
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


class _Decoder:
    """Rebuilds values from a checked structure and the file's tensors (one per `load`)."""

    def __init__(self, tensors: dict[str, torch.Tensor], device: Device) -> None:
        self.device = device
        self._raw = tensors
        self._tensors: dict[str, torch.Tensor] = {}
        self.objects: list[Any] = []

    def tensor(self, ref: Any, where: str) -> torch.Tensor:
        if not (isinstance(ref, dict) and "$tensor" in ref):
            raise _fail(f"{where} must be a tensor reference, got {_show(ref)}")
        name = ref["$tensor"]
        t = self._tensors.get(name)
        if t is None:
            # a copy: the tensors safetensors returns are views of the file's bytes
            t = self._raw[name].to(self.device.torch_device, copy=True)
            self._tensors[name] = t
        return t

    def object(self, ref: Any, where: str) -> Any:
        if not (isinstance(ref, dict) and "$obj" in ref):
            raise _fail(f"{where} must be an object reference, got {_show(ref)}")
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
        raise _fail(
            f"{where} must be null, a boolean, a number, a string, a list or a tagged object "
            f"($obj, $tensor, $dict, $tuple, $float), got {_show(v)}"
        )


def _show(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


class Fields:
    """An object's fields, read by its codec's ``decode``: typed getters that raise
    `CheckpointError` for a missing or malformed field. Fields left unread are rejected
    after ``decode`` returns. ``device`` is the `Device` to build on."""

    def __init__(self, decoder: _Decoder, who: str, data: dict[str, Any]) -> None:
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
            raise _fail(
                f"{self.who} must have the field {name!r}, got the fields {sorted(self._data)}"
            )
        self._read.add(name)
        return self._data[name]

    def _bad(self, name: str, want: str, got: Any) -> CheckpointError:
        return _fail(f"{self.who} field {name!r} must be {want}, got {_show(got)}")

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
        obj = self._decoder.object(v, f"{self.who} field {name!r}")
        if not isinstance(obj, kind):
            names = (
                kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            )
            raise _fail(
                f"{self.who} field {name!r} must be an instance of {names}, got "
                f"{type(obj).__name__}"
            )
        return obj

    def get_value(self, name: str) -> Any:
        """A plain value (see `Encoder.value`)."""
        return self._decoder.value(self.raw(name), f"{self.who} field {name!r}")

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
            raise _fail(
                f"{self.who} field {where} must have the shape {list(shape)}, got {list(t.shape)}"
            )
        if dtypes is not None and t.dtype not in dtypes:
            raise _fail(
                f"{self.who} field {where} must have the dtype "
                f"{' or '.join(_dtype_name(d) for d in dtypes)}, got {_dtype_name(t.dtype)}"
            )
        return t

    def _finish(self) -> None:
        extra = sorted(set(self._data) - self._read)
        if extra:
            raise _fail(f"{self.who} must have only the fields its type reads, got also {extra}")


# ---------------------------------------------------------------------------------------------
# save / load


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to ``path`` (a safetensors file, see the module docstring), atomically.

    ``obj``: an object of a registered type (`registered_types`), or a plain value holding
    such objects: dicts with str keys, lists, tuples, tensors, None, bools, ints, floats,
    strings (e.g. ``{"layers": [...], "optimizer": adam, "epoch": 3, "rng": tensor}``).

    Raises:
        TypeError: a value or object of an unsupported type (nothing is written).
        ValueError: a value that contains itself (nothing is written).
        OSError: the write failed (the previous file, if any, is intact).
    """
    enc = Encoder()
    root = enc.value(obj)
    structure = {"format": FORMAT, "version": VERSION, "root": root, "objects": enc.objects}
    text = json.dumps(structure, allow_nan=False, separators=(",", ":"))
    data = safetensors.torch.save(enc.tensors, metadata={METADATA_KEY: text})
    _atomic_write(Path(path), data)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync, rename onto ``path``."""
    directory = path.parent
    while True:
        tmp = directory / f".{path.name}.{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view[: 1 << 24])
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | os.PathLike[str], device: Device | str | torch.device = "cpu") -> Any:
    """Read what `save` wrote, building every object and tensor on ``device``.

    Objects come back of the same types, with the same properties, values (bit for bit) and
    optimizer state; objects saved once and referenced several times come back as one object.

    Raises:
        CheckpointError: the file is not a valid mpsnn file of this version (truncated,
            wrong header, unknown type, extra or missing tensors, wrong shapes or dtypes,
            malformed fields); nothing is returned.
        OSError: the file cannot be read.
    """
    dev = device if isinstance(device, Device) else Device(device)
    data = Path(path).read_bytes()
    header, structure = _read_header(data)
    try:
        return _build(data, header, structure, dev)
    except RecursionError as exc:
        raise _fail("the structure must nest less deeply, got a recursion error") from exc


def _build(data: bytes, header: dict[str, Any], structure: dict[str, Any], dev: Device) -> Any:
    """Check the structure against the header, then rebuild the objects and the root."""
    _check_structure(structure, header)
    try:
        raw = safetensors.torch.load(data)
    except Exception as exc:  # the library's own checks, after ours
        raise _fail(f"the tensor data must be readable by safetensors, got {exc}") from exc
    dec = _Decoder(raw, dev)
    for i, entry in enumerate(structure["objects"]):
        codec = _BY_NAME[entry["type"]]
        fields = Fields(dec, f"object {i} ({codec.name})", entry["fields"])
        try:
            obj = codec.decode(fields)
        except CheckpointError:
            raise
        except (TypeError, ValueError, RuntimeError) as exc:
            raise _fail(
                f"object {i} ({codec.name}) must be rebuildable from its fields, got "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        fields._finish()
        dec.objects.append(obj)
    return dec.value(structure["root"], "root")


def _read_header(data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """The safetensors header's tensor entries, and the mpsnn structure; checks the extent."""
    size = len(data)
    if size < 8:
        raise _fail(f"the file must be a safetensors file (at least 8 bytes), got {size} bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER or 8 + n > size:
        raise _fail(
            f"the safetensors header must fit in the file ({n} bytes announced after the "
            f"first 8), got a file of {size} bytes (truncated, or not safetensors)"
        )
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(f"the safetensors header must be UTF-8 JSON, got {exc}") from exc
    if type(header) is not dict:
        raise _fail(f"the safetensors header must be a JSON object, got {_show(header)}")
    meta = header.pop("__metadata__", None)
    if type(meta) is not dict or type(meta.get(METADATA_KEY)) is not str:
        raise _fail(
            f"the safetensors header's __metadata__ must hold the key {METADATA_KEY!r} (a "
            f"string), got {_show(meta)}"
        )
    end = 0
    for name, entry in header.items():
        _check_entry(name, entry)
        end = max(end, entry["data_offsets"][1])
    have = size - 8 - n
    if end != have:
        raise _fail(
            f"the file must hold exactly the {end} bytes of tensor data its header announces, "
            f"got {have}" + (" (truncated)" if have < end else "")
        )

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        structure = json.loads(meta[METADATA_KEY], parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        raise _fail(f"the {METADATA_KEY!r} metadata must be JSON, got {exc}") from exc
    if type(structure) is not dict:
        raise _fail(f"the {METADATA_KEY!r} metadata must be a JSON object, got {_show(structure)}")
    keys = {"format", "version", "root", "objects"}
    if structure.get("format") != FORMAT:
        raise _fail(f"the format must be {FORMAT!r}, got {_show(structure.get('format'))}")
    if "version" not in structure:
        raise _fail("the structure must state its version, got none")
    if structure["version"] != VERSION or type(structure["version"]) is not int:
        raise _fail(
            f"the format version must be {VERSION} (this mpsnn reads version {VERSION} only), "
            f"got {_show(structure['version'])}"
        )
    if set(structure) != keys:
        raise _fail(
            f"the structure must have exactly the keys {sorted(keys)}, got {sorted(structure)}"
        )
    return header, structure


def _check_entry(name: str, entry: Any) -> None:
    """One safetensors tensor entry: dtype, shape, offsets consistent."""
    if (
        type(entry) is not dict
        or set(entry) != {"dtype", "shape", "data_offsets"}
        or type(entry["shape"]) is not list
        or any(type(d) is not int or d < 0 for d in entry["shape"])
        or type(entry["data_offsets"]) is not list
        or len(entry["data_offsets"]) != 2
        or any(type(o) is not int or o < 0 for o in entry["data_offsets"])
    ):
        raise _fail(
            f"the header entry of tensor {name!r} must have a dtype, a shape and two data "
            f"offsets, got {_show(entry)}"
        )
    dtype = _CODES.get(entry["dtype"])
    if dtype is None:
        raise _fail(
            f"tensor {name!r} must have one of the dtypes {sorted(_CODES)}, got "
            f"{_show(entry['dtype'])}"
        )
    start, stop = entry["data_offsets"]
    want = math.prod(entry["shape"]) * torch.empty(0, dtype=dtype).element_size()
    if stop - start != want:
        raise _fail(
            f"tensor {name!r} must occupy {want} bytes (its shape and dtype), got offsets "
            f"[{start}, {stop}]"
        )


def _check_structure(structure: dict[str, Any], header: dict[str, Any]) -> None:
    """Objects well formed and of registered types, references in range, every tensor
    referenced and as the structure states, every object referenced."""
    objects = structure["objects"]
    if type(objects) is not list:
        raise _fail(f"the structure's objects must be a list, got {_show(objects)}")
    referenced: set[int] = set()
    used: set[str] = set()

    def walk(node: Any, limit: int, where: str) -> None:
        if type(node) is list:
            for i, x in enumerate(node):
                walk(x, limit, f"{where}.{i}")
        elif type(node) is dict:
            if "$obj" in node:
                i = node["$obj"]
                if set(node) != {"$obj"} or type(i) is not int or not 0 <= i < limit:
                    raise _fail(
                        f"{where} must reference an object before it (index < {limit}), got "
                        f"{_show(node)}"
                    )
                referenced.add(i)
            elif "$tensor" in node:
                _check_tensor_ref(node, header, where)
                used.add(node["$tensor"])
            elif set(node) == {"$dict"} and type(node["$dict"]) is dict:
                for k, x in node["$dict"].items():  # user keys: never tags
                    walk(x, limit, f"{where}.{k}")
            else:
                for k, x in node.items():
                    walk(x, limit, f"{where}.{k}")

    for i, entry in enumerate(objects):
        if type(entry) is not dict or set(entry) != {"type", "fields"}:
            raise _fail(f"object {i} must have exactly a type and fields, got {_show(entry)}")
        if entry["type"] not in _BY_NAME:
            raise _fail(
                f"object {i}'s type must be a registered type ({', '.join(sorted(_BY_NAME))}), "
                f"got {_show(entry['type'])}"
            )
        if type(entry["fields"]) is not dict:
            raise _fail(f"object {i}'s fields must be a JSON object, got {_show(entry['fields'])}")
        walk(entry["fields"], i, f"object {i} ({entry['type']})")
    walk(structure["root"], len(objects), "root")
    unreferenced = sorted(set(range(len(objects))) - referenced)
    if unreferenced:
        raise _fail(f"every object must be referenced, got unreferenced objects {unreferenced}")
    extra = sorted(set(header) - used)
    if extra:
        raise _fail(
            f"the file must hold only the tensors its structure references, got "
            f"unreferenced tensors {extra}"
        )


def _check_tensor_ref(ref: dict[str, Any], header: dict[str, Any], where: str) -> None:
    name = ref["$tensor"]
    if (
        set(ref) != {"$tensor", "dtype", "shape"}
        or type(name) is not str
        or ref["dtype"] not in _NAMES
        or type(ref["shape"]) is not list
    ):
        raise _fail(f"{where} must be a tensor reference ($tensor, dtype, shape), got {_show(ref)}")
    entry = header.get(name)
    if entry is None:
        raise _fail(f"tensor {name!r} (referenced by {where}) must be in the file, got none")
    have_dtype = _dtype_name(_CODES[entry["dtype"]])
    if have_dtype != ref["dtype"] or entry["shape"] != ref["shape"]:
        raise _fail(
            f"tensor {name!r} must be {ref['dtype']} of shape {ref['shape']} as the structure "
            f"states, got {have_dtype} of shape {entry['shape']}"
        )


# ---------------------------------------------------------------------------------------------
# codecs: descriptors


def _enc_optimizer_descriptor(d: OptimizerDescriptor, enc: Encoder) -> dict[str, Any]:
    return {
        "learning_rate": d.learning_rate,
        "gradient_rescale": d.gradient_rescale,
        "apply_gradient_clipping": d.apply_gradient_clipping,
        "gradient_clip_max": d.gradient_clip_max,
        "gradient_clip_min": d.gradient_clip_min,
        "regularization_type": d.regularization_type.name,
        "regularization_scale": d.regularization_scale,
    }


def _dec_optimizer_descriptor(f: Fields) -> OptimizerDescriptor:
    return OptimizerDescriptor(
        learning_rate=f.get_float("learning_rate"),
        gradient_rescale=f.get_float("gradient_rescale"),
        apply_gradient_clipping=f.get_bool("apply_gradient_clipping"),
        gradient_clip_max=f.get_float("gradient_clip_max"),
        gradient_clip_min=f.get_float("gradient_clip_min"),
        regularization_type=f.get_enum("regularization_type", RegularizationType),
        regularization_scale=f.get_float("regularization_scale"),
    )


_CONV_FIELDS = (
    "kernel_width", "kernel_height", "input_feature_channels", "output_feature_channels",
    "stride_in_pixels_x", "stride_in_pixels_y", "dilation_rate_x", "dilation_rate_y", "groups",
)  # fmt: skip


def _enc_convolution_descriptor(d: ConvolutionDescriptor, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(d, name) for name in _CONV_FIELDS}
    out["fused_neuron_descriptor"] = enc.value(d.fused_neuron_descriptor)
    return out


def _dec_convolution_descriptor(f: Fields) -> ConvolutionDescriptor:
    values = [f.get_int(name, 1) for name in _CONV_FIELDS]
    return ConvolutionDescriptor(*values, f.get_value("fused_neuron_descriptor"))


def _enc_neuron_descriptor(d: NeuronDescriptor, enc: Encoder) -> dict[str, Any]:
    return {
        "neuron_type": d.neuron_type.name,
        "a": d.a,
        "b": d.b,
        "c": d.c,
        "data": enc.tensor(d.data, "data"),
    }


def _dec_neuron_descriptor(f: Fields) -> NeuronDescriptor:
    kind = f.get_enum("neuron_type", NeuronType)
    data = f.get_tensor("data", dtypes=(torch.float32,), optional=True)
    if data is not None and data.dim() != 1:
        raise _fail(f"{f.who} field 'data' must be 1-D, got shape {list(data.shape)}")
    # PRELU slopes stay a host copy, as NeuronDescriptor keeps them.
    return NeuronDescriptor(kind, f.get_float("a"), f.get_float("b"), f.get_float("c"), data)


def _enc_loss_descriptor(d: LossDescriptor, enc: Encoder) -> dict[str, Any]:
    return {
        "loss_type": d.loss_type.name,
        "reduction_type": d.reduction_type.name,
        "weight": d.weight,
        "label_smoothing": d.label_smoothing,
        "number_of_classes": d.number_of_classes,
        "epsilon": d.epsilon,
        "delta": d.delta,
    }


def _dec_loss_descriptor(f: Fields) -> LossDescriptor:
    return LossDescriptor(
        f.get_enum("loss_type", LossType),
        f.get_enum("reduction_type", ReductionType),
        weight=f.get_float("weight"),
        label_smoothing=f.get_float("label_smoothing"),
        number_of_classes=f.get_int("number_of_classes", 1, optional=True),
        epsilon=f.get_float("epsilon"),
        delta=f.get_float("delta"),
    )


# ---------------------------------------------------------------------------------------------
# codecs: optimizers


def _enc_optimizer(opt: Optimizer, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {
        "label": opt.label,
        "options": int(opt.options),
        "descriptor": enc.object(opt._desc),  # the current options, learning rate included
    }
    if isinstance(opt, SGD):
        out["momentum_scale"] = opt.momentum_scale
        out["use_nesterov_momentum"] = opt.use_nesterov_momentum
    elif isinstance(opt, RMSProp):
        out["decay"], out["epsilon"] = opt.decay, opt.epsilon
    elif isinstance(opt, Adam):
        out["beta1"], out["beta2"], out["epsilon"] = opt.beta1, opt.beta2, opt.epsilon
        out["amsgrad"] = opt._amsgrad
        out["step"] = enc.tensor(opt._step, "step")
    out["hyper"] = enc.tensor(opt._hyper, "hyper")  # the device copy, exactly
    return out


def _dec_optimizer(f: Fields, kind: type) -> Optimizer:
    dev = f.device
    desc = f.get_object("descriptor", OptimizerDescriptor)
    opt: Optimizer
    if kind is SGD:
        opt = SGD(dev, f.get_float("momentum_scale"), f.get_bool("use_nesterov_momentum"), desc)
    elif kind is RMSProp:
        opt = RMSProp(dev, f.get_float("decay"), f.get_float("epsilon"), desc)
    else:
        opt = Adam(
            dev, f.get_float("beta1"), f.get_float("beta2"), f.get_float("epsilon"), 0, desc,
            amsgrad=f.get_bool("amsgrad"),
        )  # fmt: skip
        assert opt._step is not None  # made by Adam
        step = f.get_tensor("step", shape=opt._step.shape, dtypes=(opt._step.dtype,))
        opt._step.copy_(step)
    hyper = f.get_tensor("hyper", shape=opt._hyper.shape, dtypes=(opt._hyper.dtype,))
    opt._hyper.copy_(hyper)
    opt.label = f.get_str("label", optional=True)
    opt.options = KernelOptions(f.get_int("options", 0))
    return opt


# ---------------------------------------------------------------------------------------------
# codecs: data sources


def _enc_optimizer_state(
    ds: Any, enc: Encoder, public: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, list[Any]] | None:
    """``{state name: [one vector per parameter]}`` in the public layout, or None."""
    state = ds._optimizer_state
    if state is None:
        return None
    names = ds._optimizer._state_names()
    if len(names) != len(state):
        raise ValueError(
            f"[save] {type(ds).__name__}'s optimizer state must hold one list per state "
            f"vector of its optimizer {list(names)}, got {len(state)} lists"
        )
    return {
        name: [enc.tensor(public(t), f"{name}{i}") for i, t in enumerate(vectors)]
        for name, vectors in zip(names, state, strict=True)
    }


def _dec_optimizer_state(
    f: Fields,
    optimizer: Any,
    params: Sequence[torch.Tensor | None],
    internal: Callable[[torch.Tensor], torch.Tensor],
) -> list[list[torch.Tensor]] | None:
    """The optimizer state vectors, checked against ``params`` (public layout) and converted
    to the internal layout."""
    raw = f.raw("optimizer_state")
    if raw is None:
        return None
    if optimizer is None:
        raise _fail(f"{f.who} field 'optimizer_state' must be null without an optimizer, got one")
    names = list(optimizer._state_names())
    if type(raw) is not dict or sorted(raw) != sorted(names):
        raise _fail(
            f"{f.who} field 'optimizer_state' must map the optimizer's state vectors {names} "
            f"to lists, got {_show(raw)}"
        )
    present = [p for p in params if p is not None]
    out = []
    for name in names:
        refs = raw[name]
        if type(refs) is not list or not 1 <= len(refs) <= len(present):
            raise _fail(
                f"{f.who} field 'optimizer_state' must hold 1 to {len(present)} vectors for "
                f"{name!r} (one per parameter), got {_show(refs)}"
            )
        vectors = []
        for i, ref in enumerate(refs):
            p = present[i]
            t = f.resolve_tensor(
                ref, f"'optimizer_state.{name}.{i}'", shape=p.shape, dtypes=(p.dtype,)
            )
            vectors.append(internal(t))
        out.append(vectors)
    if len({len(v) for v in out}) > 1:
        raise _fail(f"{f.who} field 'optimizer_state' must hold as many vectors for every name")
    return out


def _to_ohwi(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 2, 3, 1) if t.dim() == 4 else t


def _to_oihw(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 3, 1, 2).contiguous() if t.dim() == 4 else t.clone()


def _enc_training_style(ds: Any) -> str:
    return TrainingStyle(ds.training_style).name


def _dec_training_style(f: Fields, ds: Any) -> None:
    style = f.get_enum("training_style", TrainingStyle)
    if style is not type(ds).training_style:
        ds.training_style = style


def _enc_conv_data_source(ds: TensorConvolutionDataSource, enc: Encoder) -> dict[str, Any]:
    return {
        "label": ds.label,
        "training_style": _enc_training_style(ds),
        "descriptor": enc.object(ds.descriptor()),
        "weights": enc.tensor(ds.weights(), "weights"),  # OHWI
        "biases": enc.tensor(ds.bias_terms(), "biases"),
        "optimizer": enc.object(ds.optimizer),
        "optimizer_state": _enc_optimizer_state(ds, enc, _to_ohwi),
    }


def _dec_conv_data_source(f: Fields) -> TensorConvolutionDataSource:
    desc = f.get_object("descriptor", ConvolutionDescriptor)
    w = f.get_tensor("weights", shape=desc.weights_shape, dtypes=_FLOATS)
    b = f.get_tensor(
        "biases", shape=(desc.output_feature_channels,), dtypes=(w.dtype,), optional=True
    )
    opt = f.get_object("optimizer", Optimizer, optional=True)
    ds = TensorConvolutionDataSource(desc, w, b, opt, f.get_str("label", optional=True))
    ds._descriptor = desc  # the loaded object itself (the constructor keeps a copy)
    _dec_training_style(f, ds)
    ds._optimizer_state = _dec_optimizer_state(f, opt, [ds.weights(), ds.bias_terms()], _to_oihw)
    return ds


def _enc_norm_data_source(ds: Any, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {
        "label": ds.label,
        "training_style": _enc_training_style(ds),
        "number_of_feature_channels": ds.number_of_feature_channels,
    }
    if isinstance(ds, TensorGroupNormalizationDataSource):
        out["number_of_groups"] = ds.number_of_groups
    out["epsilon"] = ds.epsilon
    out["gamma"] = enc.tensor(ds.gamma(), "gamma")
    out["beta"] = enc.tensor(ds.beta(), "beta")
    if isinstance(ds, TensorBatchNormalizationDataSource):
        out["momentum"] = ds.momentum
        out["mean"] = enc.tensor(ds.mean(), "mean")
        out["variance"] = enc.tensor(ds.variance(), "variance")
    out["optimizer"] = enc.object(ds.optimizer)
    out["optimizer_state"] = _enc_optimizer_state(ds, enc, lambda t: t)
    return out


def _dec_norm_data_source(f: Fields, kind: type) -> Any:
    c = f.get_int("number_of_feature_channels", 1)
    gamma = f.get_tensor("gamma", shape=(c,), dtypes=_FLOATS)
    same = {"shape": (c,), "dtypes": (gamma.dtype,)}  # the constructor would convert others
    beta = f.get_tensor("beta", **same)
    eps = f.get_float("epsilon")
    opt = f.get_object("optimizer", Optimizer, optional=True)
    label = f.get_str("label", optional=True)
    if kind is TensorBatchNormalizationDataSource:
        mean, var = f.get_tensor("mean", **same), f.get_tensor("variance", **same)
        ds = kind(c, gamma, beta, mean, var, eps, f.get_float("momentum"), opt, label)
    elif kind is TensorGroupNormalizationDataSource:
        ds = kind(c, f.get_int("number_of_groups", 1), gamma, beta, eps, opt, label)
    else:
        ds = kind(c, gamma, beta, eps, opt, label)
    _dec_training_style(f, ds)
    ds._optimizer_state = _dec_optimizer_state(f, opt, [ds.gamma(), ds.beta()], torch.clone)
    return ds


# ---------------------------------------------------------------------------------------------
# codecs: kernels


def _enc_kernel_properties(k: CNNKernel) -> dict[str, Any]:
    """What every `CNNKernel` can be configured with (not the destination allocator)."""
    pad = k.padding
    if type(pad) is not DefaultPadding:
        raise TypeError(
            f"[save] {type(k).__name__}.padding must be a DefaultPadding to be saved (a custom "
            f"policy is code), got {type(pad).__name__}"
        )
    clip = k.clip_rect
    return {
        "label": k.label,
        "options": int(k.options),
        "offset": list(k.offset),
        "clip_rect": [*clip.origin, *clip.size],
        "edge_mode": k.edge_mode.name,
        "source_feature_channel_offset": k.source_feature_channel_offset,
        "source_feature_channel_max_count": k.source_feature_channel_max_count,
        "destination_feature_channel_offset": k.destination_feature_channel_offset,
        "padding": {
            "method": int(pad.padding_method),
            "label": pad.label,
            "sets_clamp": pad._sets_clamp,
        },
    }


def _dec_kernel_properties(f: Fields, k: CNNKernel) -> None:
    k.label = f.get_str("label", optional=True)
    k.options = KernelOptions(f.get_int("options", 0))
    k.offset = Offset(*f.get_ints("offset", 3))
    clip = f.get_ints("clip_rect", 6)
    k.clip_rect = Region(Origin(*clip[:3]), Size(*clip[3:]))
    k.edge_mode = f.get_enum("edge_mode", EdgeMode)
    k.source_feature_channel_offset = f.get_int("source_feature_channel_offset", 0)
    k.source_feature_channel_max_count = f.get_int("source_feature_channel_max_count", 1)
    k.destination_feature_channel_offset = f.get_int("destination_feature_channel_offset", 0)
    pad = f.raw("padding")
    if (
        type(pad) is not dict
        or set(pad) != {"method", "label", "sets_clamp"}
        or type(pad["method"]) is not int
        or not (pad["label"] is None or type(pad["label"]) is str)
        or type(pad["sets_clamp"]) is not bool
    ):
        raise _fail(
            f"{f.who} field 'padding' must hold a method (int), a label (string or null) and "
            f"sets_clamp (boolean), got {_show(pad)}"
        )
    padding = DefaultPadding(PaddingMethod(pad["method"]), label=pad["label"])
    padding._sets_clamp = pad["sets_clamp"]
    k.padding = padding


def _enc_convolution(k: Any, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {
        "data_source": enc.object(k.data_source),
        **_enc_kernel_properties(k),
        "accumulator_precision_option": k.accumulator_precision_option.name,
        # the kernel's master weights: they differ from the data source's until a reload
        "weights": enc.tensor(k.weights, "weights"),
        "biases": enc.tensor(k.biases, "biases"),
    }
    if isinstance(k, ConvolutionTranspose):
        out["kernel_offset_x"] = k.kernel_offset_x
        out["kernel_offset_y"] = k.kernel_offset_y
    return out


def _dec_convolution(f: Fields, kind: type) -> Any:
    ds = f.get_object("data_source", ConvolutionDataSource)
    k = kind(f.device, ds)
    _dec_kernel_properties(f, k)
    k.accumulator_precision_option = f.get_enum(
        "accumulator_precision_option", ConvolutionAccumulatorPrecisionOption
    )
    masters = k._weights
    dtype = masters.weight.dtype
    w = f.get_tensor("weights", shape=tuple(k.weights.shape), dtypes=(dtype,))
    b = f.get_tensor("biases", shape=(k.output_feature_channels,), dtypes=(dtype,), optional=True)
    masters.load_ohwi(w, b)
    if b is None:
        masters.bias = None
    if kind is ConvolutionTranspose:
        k.kernel_offset_x = f.get_int("kernel_offset_x")
        k.kernel_offset_y = f.get_int("kernel_offset_y")
    return k


def _enc_batch_normalization(k: BatchNormalization, enc: Encoder) -> dict[str, Any]:
    return {
        "data_source": enc.object(k.data_source),
        "fused_neuron_descriptor": enc.value(k.fused_neuron_descriptor),
        **_enc_kernel_properties(k),
        "epsilon": k.epsilon,
        "gamma": enc.tensor(k.gamma, "gamma"),
        "beta": enc.tensor(k.beta, "beta"),
        "mean": enc.tensor(k.mean, "mean"),
        "variance": enc.tensor(k.variance, "variance"),
    }


def _dec_batch_normalization(f: Fields) -> BatchNormalization:
    ds = f.get_object("data_source", BatchNormalizationDataSource)
    k = BatchNormalization(f.device, ds, f.get_value("fused_neuron_descriptor"))
    _dec_kernel_properties(f, k)
    k.epsilon = f.get_float("epsilon")
    same = {"shape": tuple(k.gamma.shape), "dtypes": (k.gamma.dtype,)}
    k._affine.load(f.get_tensor("gamma", **same), f.get_tensor("beta", **same))
    k._running.load(f.get_tensor("mean", **same), f.get_tensor("variance", **same))
    return k


def _enc_group_normalization(k: Any, enc: Encoder) -> dict[str, Any]:
    return {
        "data_source": enc.object(k.data_source),
        **_enc_kernel_properties(k),
        "epsilon": k.epsilon,
        "gamma": enc.tensor(k.gamma, "gamma"),
        "beta": enc.tensor(k.beta, "beta"),
    }


def _dec_group_normalization(f: Fields, kind: type) -> Any:
    sources = {
        InstanceNormalization: InstanceNormalizationDataSource,
        GroupNormalization: GroupNormalizationDataSource,
    }
    k = kind(f.device, f.get_object("data_source", sources[kind]))
    _dec_kernel_properties(f, k)
    k.epsilon = f.get_float("epsilon")
    same = {"shape": tuple(k.gamma.shape), "dtypes": (k.gamma.dtype,)}
    k._affine.load(f.get_tensor("gamma", **same), f.get_tensor("beta", **same))
    return k


_POOL_FIELDS = (
    "kernel_width", "kernel_height", "stride_in_pixels_x", "stride_in_pixels_y",
    "dilation_rate_x", "dilation_rate_y",
)  # fmt: skip


def _enc_pooling(k: Any, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(k, name) for name in _POOL_FIELDS}
    out.update(_enc_kernel_properties(k))
    if isinstance(k, PoolingAverage):
        out["zero_pad_size_x"] = k.zero_pad_size_x
        out["zero_pad_size_y"] = k.zero_pad_size_y
    return out


def _dec_pooling(f: Fields, kind: type) -> Any:
    kw, kh, sx, sy, dx, dy = (f.get_int(name, 1) for name in _POOL_FIELDS)
    if kind is DilatedPoolingMax:
        k = kind(f.device, kw, kh, dx, dy, sx, sy)
    else:
        k = kind(f.device, kw, kh, sx, sy, dilation_rate_x=dx, dilation_rate_y=dy)
    _dec_kernel_properties(f, k)
    if kind is PoolingAverage:
        k.zero_pad_size_x = f.get_int("zero_pad_size_x", 0)
        k.zero_pad_size_y = f.get_int("zero_pad_size_y", 0)
    return k


def _enc_neuron(k: Neuron, enc: Encoder) -> dict[str, Any]:
    return {"neuron_descriptor": enc.object(k.neuron_descriptor), **_enc_kernel_properties(k)}


def _dec_neuron(f: Fields) -> Neuron:
    k = Neuron(f.device, f.get_object("neuron_descriptor", NeuronDescriptor))
    _dec_kernel_properties(f, k)
    return k


def _enc_dropout(k: Dropout, enc: Encoder) -> dict[str, Any]:
    stride = k.mask_stride_in_pixels
    return {
        "keep_probability": k.keep_probability,
        "seed": k.seed,
        "mask_stride_in_pixels": [stride.width, stride.height, stride.depth],
        **_enc_kernel_properties(k),
        "counter": enc.tensor(k._counter, "counter"),  # encodes so far: the next masks
    }


def _dec_dropout(f: Fields) -> Dropout:
    stride = Size(*f.get_ints("mask_stride_in_pixels", 3))
    k = Dropout(f.device, f.get_float("keep_probability"), f.get_int("seed", 0), stride)
    _dec_kernel_properties(f, k)
    k._counter.copy_(f.get_tensor("counter", shape=k._counter.shape, dtypes=(k._counter.dtype,)))
    return k


def _enc_plain_kernel(k: CNNKernel, enc: Encoder) -> dict[str, Any]:
    return _enc_kernel_properties(k)


def _dec_plain_kernel(f: Fields, kind: type) -> Any:
    k = kind(f.device)
    _dec_kernel_properties(f, k)
    return k


def _enc_loss(k: Loss, enc: Encoder) -> dict[str, Any]:
    return {"loss_descriptor": enc.object(k._desc), **_enc_kernel_properties(k)}


def _dec_loss(f: Fields) -> Loss:
    k = Loss(f.device, f.get_object("loss_descriptor", LossDescriptor))
    _dec_kernel_properties(f, k)
    return k


def _per_class(decode: Callable[[Fields, type], Any], kind: type) -> Callable[[Fields], Any]:
    return lambda f: decode(f, kind)


# The built-in codec table: one line per class.
for _cls, _encode, _decode in (
    (OptimizerDescriptor, _enc_optimizer_descriptor, _dec_optimizer_descriptor),
    (ConvolutionDescriptor, _enc_convolution_descriptor, _dec_convolution_descriptor),
    (NeuronDescriptor, _enc_neuron_descriptor, _dec_neuron_descriptor),
    (LossDescriptor, _enc_loss_descriptor, _dec_loss_descriptor),
    (SGD, _enc_optimizer, _per_class(_dec_optimizer, SGD)),
    (RMSProp, _enc_optimizer, _per_class(_dec_optimizer, RMSProp)),
    (Adam, _enc_optimizer, _per_class(_dec_optimizer, Adam)),
    (TensorConvolutionDataSource, _enc_conv_data_source, _dec_conv_data_source),
    (
        TensorBatchNormalizationDataSource,
        _enc_norm_data_source,
        _per_class(_dec_norm_data_source, TensorBatchNormalizationDataSource),
    ),
    (
        TensorInstanceNormalizationDataSource,
        _enc_norm_data_source,
        _per_class(_dec_norm_data_source, TensorInstanceNormalizationDataSource),
    ),
    (
        TensorGroupNormalizationDataSource,
        _enc_norm_data_source,
        _per_class(_dec_norm_data_source, TensorGroupNormalizationDataSource),
    ),
    (Convolution, _enc_convolution, _per_class(_dec_convolution, Convolution)),
    (FullyConnected, _enc_convolution, _per_class(_dec_convolution, FullyConnected)),
    (ConvolutionTranspose, _enc_convolution, _per_class(_dec_convolution, ConvolutionTranspose)),
    (BatchNormalization, _enc_batch_normalization, _dec_batch_normalization),
    (
        InstanceNormalization,
        _enc_group_normalization,
        _per_class(_dec_group_normalization, InstanceNormalization),
    ),
    (
        GroupNormalization,
        _enc_group_normalization,
        _per_class(_dec_group_normalization, GroupNormalization),
    ),
    (PoolingMax, _enc_pooling, _per_class(_dec_pooling, PoolingMax)),
    (PoolingAverage, _enc_pooling, _per_class(_dec_pooling, PoolingAverage)),
    (PoolingL2Norm, _enc_pooling, _per_class(_dec_pooling, PoolingL2Norm)),
    (DilatedPoolingMax, _enc_pooling, _per_class(_dec_pooling, DilatedPoolingMax)),
    (Neuron, _enc_neuron, _dec_neuron),
    (Dropout, _enc_dropout, _dec_dropout),
    (SoftMax, _enc_plain_kernel, _per_class(_dec_plain_kernel, SoftMax)),
    (LogSoftMax, _enc_plain_kernel, _per_class(_dec_plain_kernel, LogSoftMax)),
    (Loss, _enc_loss, _dec_loss),
):
    register_codec(_cls, _encode, _decode)
del _cls, _encode, _decode
