"""The bytes of a file: the safetensors layout written and read as a stream, atomic writes and
the temporary files they leave when a process dies mid-save.

Layout (safetensors): 8 bytes, the little-endian length ``n`` of the header; ``n`` bytes of
JSON, ``{"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [...],
"data_offsets": [start, stop]}, ...}`` (padded with spaces to a multiple of 8); then the
tensors' bytes, each at ``[start, stop)`` of the data, the tensors tiling the data without gaps
or overlaps.

Memory: `write_atomically` writes each tensor from its own memory (a CPU tensor that is
contiguous) or through one staging buffer of 16 MiB (a strided view, a tensor on a GPU), never
building the file in memory; `SafetensorsFile` reads the header first, checks it, and reads a tensor
only when asked for it, straight into the tensor's own memory. A save or a load therefore
needs the file's size in memory once, plus at most one chunk.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import secrets
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

import torch

from mpsnn.io.codec import CODES, DTYPES, fail, show

__all__ = ["SafetensorsFile", "remove_stale_temporary_files", "write_atomically"]

MAX_HEADER = 100_000_000  # safetensors' own limit
_CHUNK = 1 << 24
#: a temporary file written before this module named them with the writer's process id is
#: taken for a dead save's once it has not changed for this long (seconds)
LEGACY_TEMPORARY_AGE = 3600.0

_in_progress: set[str] = set()  # this process's temporary files being written (absolute)
_lock = threading.Lock()


# ---------------------------------------------------------------------------------------------
# writing


def write_atomically(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Write ``tensors`` (any device, any strides) and ``metadata`` to ``path`` as one
    safetensors file: to a temporary file ``.<name>.<pid>.<random>.tmp`` beside it (after
    removing the temporary files of dead saves to the same name), fsynced, renamed onto
    ``path``, and the directory fsynced where the platform allows. A write that raises
    (also ``KeyboardInterrupt``) removes its temporary file."""
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))  # aligned offsets
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    directory = path.parent
    remove_stale_temporary_files(path)
    fd, tmp = _create_temporary(path)
    try:
        try:
            _write_all(fd, struct.pack("<Q", len(text)) + text)
            stage: list[torch.Tensor] = []
            for name in names:
                _write_tensor(fd, tensors[name], stage)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        with _lock:
            _in_progress.discard(os.path.abspath(tmp))
    _fsync_directory(directory)


def _create_temporary(path: Path) -> tuple[int, Path]:
    while True:
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        with _lock:
            _in_progress.add(os.path.abspath(tmp))
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
        except BaseException:
            with _lock:
                _in_progress.discard(os.path.abspath(tmp))
            raise


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view[:_CHUNK])
        view = view[written:]


def _write_tensor(fd: int, t: torch.Tensor, stage: list[torch.Tensor]) -> None:
    """The bytes of ``t`` in row-major order: from its own memory when it is a contiguous CPU
    tensor, else copied in chunks of leading-dimension slices (at most 16 MiB) through one
    staging buffer (``stage``: empty, or the buffer of this save), so that the copies of a
    save neither add up nor fragment the heap."""
    t = t.detach()
    if t.numel() == 0:
        return
    if t.device.type == "cpu" and t.is_contiguous():
        _write_all(fd, _bytes_of(t))
        return
    if t.dim() == 0:
        t = t.reshape(1)
    row = t[0].numel() * t.element_size()
    if row > _CHUNK:  # (two or more dimensions: one element is at most 8 bytes)
        for i in range(t.shape[0]):
            _write_tensor(fd, t[i], stage)
        return
    if not stage:
        stage.append(torch.empty(_CHUNK, dtype=torch.uint8))
    rows = _CHUNK // row
    for i in range(0, t.shape[0], rows):
        part = t[i : i + rows]
        out = stage[0][: part.numel() * part.element_size()].view(part.dtype).view(part.shape)
        out.copy_(part)  # a GPU tensor: a synchronous copy on the current stream
        _write_all(fd, _bytes_of(out))


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor, as bytes: no copy, and unlike ``numpy()`` no
    change to the tensor (whose storage stays resizable). ``t`` must outlive the view."""
    size = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * size).from_address(t.data_ptr())).cast("B")


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


# ---------------------------------------------------------------------------------------------
# temporary files of dead saves


def remove_stale_temporary_files(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files that saves to ``path`` left when their process died
    mid-save; returns them.

    Only mpsnn's own names are touched: ``.<name>.<pid>.<16 hex digits>.tmp`` whose process
    ``pid`` is not running on this machine (this process's own only when no save of it is
    writing the file), and ``.<name>.<16 hex digits>.tmp`` (written before the names held the
    process id) unchanged for `LEGACY_TEMPORARY_AGE` seconds. A save in progress in a live
    process keeps its file. Files that cannot be listed or removed are left.
    """
    target = Path(path)
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(?:(\d+)\.)?[0-9a-f]{{16}}\.tmp")
    removed: list[Path] = []
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            pid = match.group(1)
            if pid is None:
                stale = time.time() - entry.stat(follow_symlinks=False).st_mtime > (
                    LEGACY_TEMPORARY_AGE
                )
            else:
                stale = not _writing(int(pid), entry.path)
            if stale:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


def _writing(pid: int, path: str) -> bool:
    """Whether process ``pid`` may still be writing ``path``."""
    if pid == os.getpid():
        with _lock:
            return os.path.abspath(path) in _in_progress
    if os.name != "posix":  # no harmless probe of a process: keep the file
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (no pid is that large)
        return False
    except OSError:  # alive, another user's (or not ours to probe)
        return True
    return True


# ---------------------------------------------------------------------------------------------
# reading


class SafetensorsFile:
    """A safetensors file opened for reading: the header is read and checked when opened, the
    tensors are read one by one when asked for (`read`). ``metadata``: the header's
    ``__metadata__`` as found (None when absent; its reader checks it).

    Checks, each a `CheckpointError`: the path names a regular file (not a device, a pipe or a
    directory: the path is opened without blocking and checked before anything is read); at
    least 8 bytes; a header length within safetensors' limit and the file; a UTF-8 JSON object;
    each tensor entry with a known dtype, a shape of
    non-negative ints and data offsets spanning its bytes; the tensors tiling the data; the
    data exactly as long as the file's rest. ``OSError``: the file cannot be opened or read.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        self._fd = os.open(path, flags)
        try:
            info = os.fstat(self._fd)
            if not stat.S_ISREG(info.st_mode):
                raise fail(f"the path must name a regular file, got {_kind(info.st_mode)}")
            self.size = info.st_size
            self.entries, self.metadata, self._data = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _pread(self, count: int, offset: int, into: memoryview | None = None) -> memoryview:
        """``count`` bytes at ``offset`` (into ``into`` when given); a short read (the file
        shrank since it was opened) is a `CheckpointError`."""
        view = into if into is not None else memoryview(bytearray(count))
        done = 0
        while done < count:
            if hasattr(os, "preadv"):
                got = os.preadv(self._fd, [view[done : done + _CHUNK]], offset + done)
            else:  # pragma: no cover (Windows: no positional scatter read)
                os.lseek(self._fd, offset + done, os.SEEK_SET)
                part = os.read(self._fd, min(_CHUNK, count - done))
                got = len(part)
                view[done : done + got] = part
            if got == 0:
                raise fail(
                    f"the file must hold {offset + count} bytes while it is read, got "
                    f"{offset + done} (it was truncated)"
                )
            done += got
        return view

    def _read_header(self) -> tuple[dict[str, Any], Any, int]:
        size = self.size
        if size < 8:
            raise fail(f"the file must be a safetensors file (at least 8 bytes), got {size} bytes")
        (n,) = struct.unpack("<Q", self._pread(8, 0))
        if n > MAX_HEADER or 8 + n > size:
            raise fail(
                f"the safetensors header must fit in the file ({n} bytes announced after the "
                f"first 8), got a file of {size} bytes (truncated, or not safetensors)"
            )
        try:
            header = json.loads(bytes(self._pread(n, 8)).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise fail(f"the safetensors header must be UTF-8 JSON, got {exc}") from exc
        if type(header) is not dict:
            raise fail(f"the safetensors header must be a JSON object, got {show(header)}")
        meta = header.pop("__metadata__", None)  # checked by the reader of the file
        for name, entry in header.items():
            _check_entry(name, entry)
        end = 0
        for name in sorted(header, key=lambda k: header[k]["data_offsets"]):
            start, stop = header[name]["data_offsets"]
            if start != end:
                raise fail(
                    f"the tensors must tile the data without gaps or overlaps, got tensor "
                    f"{name!r} at [{start}, {stop}] after {end} bytes"
                )
            end = max(end, stop)
        have = size - 8 - n
        if end != have:
            raise fail(
                f"the file must hold exactly the {end} bytes of tensor data its header "
                f"announces, got {have}" + (" (truncated)" if have < end else "")
            )
        return header, meta, 8 + n

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name``: a new CPU tensor owning its memory, read straight into it."""
        entry = self.entries[name]
        start, stop = entry["data_offsets"]
        buffer = torch.empty(stop - start, dtype=torch.uint8)
        if stop > start:
            self._pread(stop - start, self._data + start, _bytes_of(buffer))
        return buffer.view(CODES[entry["dtype"]]).reshape(entry["shape"])


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def _check_entry(name: str, entry: Any) -> None:
    """One safetensors tensor entry: dtype, shape, offsets consistent."""
    if (
        type(entry) is not dict
        or set(entry) != {"dtype", "shape", "data_offsets"}
        or type(entry["shape"]) is not list
        or any(type(d) is not int or not 0 <= d < 2**62 for d in entry["shape"])
        or math.prod(d for d in entry["shape"] if d) >= 2**62  # an int64 element count
        or type(entry["dtype"]) is not str
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
