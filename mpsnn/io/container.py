"""The document of a file: `save` and `load`, the checks of the structure (the bytes, the
header's checks and atomic writes: `mpsnn.io.files`).

One safetensors file. Its tensors hold every tensor of the saved objects (CPU, contiguous,
in their own dtype); its header's ``__metadata__`` map holds one key, ``"mpsnn"``, whose
value is a JSON document::

    {"format": "mpsnn", "version": 1, "root": <value>, "objects": [<object>, ...]}

(see `mpsnn.io` for the values and the objects table). `load` checks the header, the
document and every tensor reference before any codec runs; then it decodes the objects in
table order.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

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
from mpsnn.io.files import SafetensorsFile, write_atomically

__all__ = ["FORMAT", "METADATA_KEY", "VERSION", "load", "save"]

FORMAT = "mpsnn"
VERSION = 1
METADATA_KEY = "mpsnn"


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to ``path`` (a safetensors file, see the module docstring), atomically.

    ``obj``: an object of a registered type (`registered_types`), or a plain value holding
    such objects: dicts with str keys, lists, tuples, tensors, None, bools, ints, floats,
    strings (e.g. ``{"layers": [...], "optimizer": adam, "epoch": 3, "rng": tensor}``).

    The file is written tensor by tensor from the tensors' own memory (see
    `mpsnn.io.files`): besides the saved objects, a save needs at most a 16 MiB chunk. The
    temporary files of saves to ``path`` whose process died are removed first.

    Raises:
        TypeError: a value or object of an unsupported type (nothing is written).
        ValueError: a value that contains itself (nothing is written).
        OSError: the write failed (the previous file, if any, is intact).
    """
    enc = Encoder()
    root = enc.value(obj)
    structure = {"format": FORMAT, "version": VERSION, "root": root, "objects": enc.objects}
    text = json.dumps(structure, allow_nan=False, separators=(",", ":"))
    write_atomically(Path(path), enc.tensors, {METADATA_KEY: text})


def load(path: str | os.PathLike[str], device: Device | str | torch.device = "cpu") -> Any:
    """Read what `save` wrote, building every object and tensor on ``device``.

    Objects come back of the same types, with the same properties, values (bit for bit) and
    optimizer state; objects saved once and referenced several times come back as one object.

    ``path`` must name a regular file. Its header and structure are read and checked before
    any tensor data; each tensor is then read straight into its own memory (on a GPU: through
    a CPU tensor of its size), so a load needs about the file's size in memory.

    Raises:
        CheckpointError: the file is not a valid mpsnn file of this version (not a regular
            file, truncated, wrong header, unknown type, extra or missing tensors, wrong
            shapes or dtypes, malformed fields); nothing is returned.
        OSError: the file cannot be read.
    """
    dev = device if isinstance(device, Device) else Device(device)
    with SafetensorsFile(path) as file:
        structure = _read_structure(file.metadata)
        try:
            return _build(file, structure, dev)
        except RecursionError as exc:
            raise fail("the structure must nest less deeply, got a recursion error") from exc


def _build(file: SafetensorsFile, structure: dict[str, Any], dev: Device) -> Any:
    """Check the structure against the header, then rebuild the objects and the root."""
    uses = _check_structure(structure, file.entries)
    dec = Decoder(file.read, dev, uses)
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


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: JSON numbers are finite (``$float`` tags say inf)
        raise ValueError(f"{text} is not a finite number")
    return value


def _read_structure(meta: Any) -> dict[str, Any]:
    """The mpsnn document of the header's ``__metadata__``: JSON with finite numbers only
    (no NaN or Infinity literals, no number that overflows a float), format and version."""
    if type(meta) is not dict or type(meta.get(METADATA_KEY)) is not str:
        raise fail(
            f"the safetensors header's __metadata__ must hold the key {METADATA_KEY!r} (a "
            f"string), got {show(meta)}"
        )
    try:
        structure = json.loads(meta[METADATA_KEY], parse_constant=_no_constant,
                               parse_float=_finite)  # fmt: skip
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
    return structure


def _check_structure(structure: dict[str, Any], header: dict[str, Any]) -> dict[str, int]:
    """Objects well formed and of registered types, references in range, every tensor
    referenced and as the structure states, every object referenced. Returns how often each
    tensor is referenced."""
    objects = structure["objects"]
    if type(objects) is not list:
        raise fail(f"the structure's objects must be a list, got {show(objects)}")
    referenced: set[int] = set()
    used: dict[str, int] = {}
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
                used[node["$tensor"]] = used.get(node["$tensor"], 0) + 1
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
    extra = sorted(set(header) - set(used))
    if extra:
        raise fail(
            f"the file must hold only the tensors its structure references, got "
            f"unreferenced tensors {extra}"
        )
    return used


def _check_tensor_ref(ref: dict[str, Any], header: dict[str, Any], where: str) -> None:
    name = ref["$tensor"]
    if (
        set(ref) != {"$tensor", "dtype", "shape"}
        or type(name) is not str
        or type(ref["dtype"]) is not str
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
