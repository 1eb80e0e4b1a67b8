"""The file: `save` and `load`, the safetensors container, its checks, atomic writes.

One safetensors file. Its tensors hold every tensor of the saved objects (CPU, contiguous,
in their own dtype); its header's ``__metadata__`` map holds one key, ``"mpsnn"``, whose
value is a JSON document::

    {"format": "mpsnn", "version": 1, "root": <value>, "objects": [<object>, ...]}

(see `mpsnn.io` for the values and the objects table). `load` checks the header, the
document and every tensor reference before any codec runs; then it decodes the objects in
table order.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import struct
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from mpsnn.core.device import Device
from mpsnn.errors import CheckpointError
from mpsnn.io.codec import (
    CODES,
    NAMES,
    Decoder,
    Encoder,
    Fields,
    codec_of_name,
    dtype_name,
    fail,
    registered_types,
    show,
)

__all__ = ["FORMAT", "METADATA_KEY", "VERSION", "load", "save"]

FORMAT = "mpsnn"
VERSION = 1
METADATA_KEY = "mpsnn"
_MAX_HEADER = 100_000_000  # safetensors' own limit


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
        raise fail("the structure must nest less deeply, got a recursion error") from exc


def _build(data: bytes, header: dict[str, Any], structure: dict[str, Any], dev: Device) -> Any:
    """Check the structure against the header, then rebuild the objects and the root."""
    _check_structure(structure, header)
    try:
        raw = safetensors.torch.load(data)
    except Exception as exc:  # the library's own checks, after ours
        raise fail(f"the tensor data must be readable by safetensors, got {exc}") from exc
    dec = Decoder(raw, dev)
    for i, entry in enumerate(structure["objects"]):
        codec = codec_of_name(entry["type"])
        assert codec is not None  # checked by _check_structure
        fields = Fields(dec, f"object {i} ({codec.name})", entry["fields"])
        try:
            obj = codec.decode(fields)
        except CheckpointError:
            raise
        except (TypeError, ValueError, RuntimeError) as exc:
            raise fail(
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
        raise fail(f"the file must be a safetensors file (at least 8 bytes), got {size} bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _MAX_HEADER or 8 + n > size:
        raise fail(
            f"the safetensors header must fit in the file ({n} bytes announced after the "
            f"first 8), got a file of {size} bytes (truncated, or not safetensors)"
        )
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise fail(f"the safetensors header must be UTF-8 JSON, got {exc}") from exc
    if type(header) is not dict:
        raise fail(f"the safetensors header must be a JSON object, got {show(header)}")
    meta = header.pop("__metadata__", None)
    if type(meta) is not dict or type(meta.get(METADATA_KEY)) is not str:
        raise fail(
            f"the safetensors header's __metadata__ must hold the key {METADATA_KEY!r} (a "
            f"string), got {show(meta)}"
        )
    end = 0
    for name, entry in header.items():
        _check_entry(name, entry)
        end = max(end, entry["data_offsets"][1])
    have = size - 8 - n
    if end != have:
        raise fail(
            f"the file must hold exactly the {end} bytes of tensor data its header announces, "
            f"got {have}" + (" (truncated)" if have < end else "")
        )

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        structure = json.loads(meta[METADATA_KEY], parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        raise fail(f"the {METADATA_KEY!r} metadata must be JSON, got {exc}") from exc
    if type(structure) is not dict:
        raise fail(f"the {METADATA_KEY!r} metadata must be a JSON object, got {show(structure)}")
    keys = {"format", "version", "root", "objects"}
    if structure.get("format") != FORMAT:
        raise fail(f"the format must be {FORMAT!r}, got {show(structure.get('format'))}")
    if "version" not in structure:
        raise fail("the structure must state its version, got none")
    if structure["version"] != VERSION or type(structure["version"]) is not int:
        raise fail(
            f"the format version must be {VERSION} (this mpsnn reads version {VERSION} only), "
            f"got {show(structure['version'])}"
        )
    if set(structure) != keys:
        raise fail(
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
        raise fail(
            f"the header entry of tensor {name!r} must have a dtype, a shape and two data "
            f"offsets, got {show(entry)}"
        )
    dtype = CODES.get(entry["dtype"])
    if dtype is None:
        raise fail(
            f"tensor {name!r} must have one of the dtypes {sorted(CODES)}, got "
            f"{show(entry['dtype'])}"
        )
    start, stop = entry["data_offsets"]
    want = math.prod(entry["shape"]) * torch.empty(0, dtype=dtype).element_size()
    if stop - start != want:
        raise fail(
            f"tensor {name!r} must occupy {want} bytes (its shape and dtype), got offsets "
            f"[{start}, {stop}]"
        )


def _check_structure(structure: dict[str, Any], header: dict[str, Any]) -> None:
    """Objects well formed and of registered types, references in range, every tensor
    referenced and as the structure states, every object referenced."""
    objects = structure["objects"]
    if type(objects) is not list:
        raise fail(f"the structure's objects must be a list, got {show(objects)}")
    referenced: set[int] = set()
    used: set[str] = set()
    names = registered_types()

    def walk(node: Any, limit: int, where: str) -> None:
        if type(node) is list:
            for i, x in enumerate(node):
                walk(x, limit, f"{where}.{i}")
        elif type(node) is dict:
            if "$obj" in node:
                i = node["$obj"]
                if set(node) != {"$obj"} or type(i) is not int or not 0 <= i < limit:
                    raise fail(
                        f"{where} must reference an object before it (index < {limit}), got "
                        f"{show(node)}"
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
            raise fail(f"object {i} must have exactly a type and fields, got {show(entry)}")
        if codec_of_name(entry["type"]) is None:
            raise fail(
                f"object {i}'s type must be a registered type ({', '.join(sorted(names))}), "
                f"got {show(entry['type'])}"
            )
        if type(entry["fields"]) is not dict:
            raise fail(f"object {i}'s fields must be a JSON object, got {show(entry['fields'])}")
        walk(entry["fields"], i, f"object {i} ({entry['type']})")
    walk(structure["root"], len(objects), "root")
    unreferenced = sorted(set(range(len(objects))) - referenced)
    if unreferenced:
        raise fail(f"every object must be referenced, got unreferenced objects {unreferenced}")
    extra = sorted(set(header) - used)
    if extra:
        raise fail(
            f"the file must hold only the tensors its structure references, got "
            f"unreferenced tensors {extra}"
        )


def _check_tensor_ref(ref: dict[str, Any], header: dict[str, Any], where: str) -> None:
    name = ref["$tensor"]
    if (
        set(ref) != {"$tensor", "dtype", "shape"}
        or type(name) is not str
        or ref["dtype"] not in NAMES
        or type(ref["shape"]) is not list
    ):
        raise fail(f"{where} must be a tensor reference ($tensor, dtype, shape), got {show(ref)}")
    entry = header.get(name)
    if entry is None:
        raise fail(f"tensor {name!r} (referenced by {where}) must be in the file, got none")
    have_dtype = dtype_name(CODES[entry["dtype"]])
    if have_dtype != ref["dtype"] or entry["shape"] != ref["shape"]:
        raise fail(
            f"tensor {name!r} must be {ref['dtype']} of shape {ref['shape']} as the structure "
            f"states, got {have_dtype} of shape {entry['shape']}"
        )
