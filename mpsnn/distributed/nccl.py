"""Direct NCCL calls for the small collectives on a data-parallel step's critical path.

Synchronized batch normalization makes two collectives per layer and step that the next
kernel waits for: the all-gather of the statistics and the all-reduce of the gradient sums, a
few KiB each. Through ``torch.distributed`` each one is a process-group call: it records an
event on the caller's stream, makes NCCL's own stream wait for it, launches there, records
another event and builds a work object, and the caller waits for that: on two H200s of one
host about twice the host time and wall time of a direct call, and 3 µs more inside a CUDA
graph (``python -m benchmarks.tools.nccl_latency``; benchmarks/RESULTS.md, "The critical-path
collectives on a direct NCCL communicator").

`NcclComm` is a communicator of the process group's ranks of its own (NCCL's C API through
``ctypes``: no extension to build; the library of PyTorch's own NCCL version, which its CUDA
build ships), whose collectives run on the current stream of the tensor's device: nothing to
wait for, ordered with the kernels around them as any kernel is, and recorded into a CUDA
graph like them. The values are NCCL's, as through ``torch.distributed`` (the same library;
with more than two ranks the two communicators may choose other algorithms, and a sum's last
bits may differ).

Only latency-bound, synchronous collectives go this way; the weight-gradient buckets keep the
process group's asynchronous all-reduces, which overlap the backward on NCCL's stream. The two
communicators' kernels may then run at once; every rank issues both sequences in one program
order, and NCCL's kernels take a few dozen thread blocks at most, so they fit on the device
together (what NCCL asks of communicators used concurrently).

One communicator per process group and device (`shared`), ended by `close_all` (which
`mpsnn.DistributedRun.close` calls). Faults: a collective launched here returns at once; a
peer that died or hung leaves its kernel waiting, and the rank's `mpsnn.RankMonitor` ends it
within its timeout (the process group's own timeout does not watch these kernels).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from typing import Any

import torch
import torch.distributed as dist

from mpsnn.core.device import _raw_stream

__all__ = ["NcclComm", "close_all"]

# ncclDataType_t and ncclRedOp_t (nccl.h; stable since NCCL 2.0, bfloat16 since 2.10)
_DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.bool: 1, torch.int32: 2, torch.int64: 4,
    torch.float16: 6, torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}  # fmt: skip
_SUM = 0
_MIN_VERSION = 21000  # 2.10.0: bfloat16


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]  # NCCL_UNIQUE_ID_BYTES


def _candidates() -> list[str]:
    """Where NCCL may be: PyTorch's pip dependency first (the library its process groups
    load), then the loader's search path."""
    found = []
    try:
        import nvidia.nccl  # type: ignore[import-not-found]

        for root in nvidia.nccl.__path__:
            found += sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
    except ImportError:
        pass
    return [*found, "libnccl.so.2"]


def _torch_version() -> int | None:
    """The version code (``major * 10000 + minor * 100 + patch``) of the NCCL PyTorch was built
    with, or None where PyTorch has none."""
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return None
    return major * 10000 + minor * 100 + patch


@functools.cache
def _library() -> Any:
    """NCCL's C library with the signatures used here, or None: none found, older than 2.10,
    or another version than PyTorch's own (whose process groups the values must match)."""
    want = _torch_version()
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        version = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(version)) != 0 or version.value < _MIN_VERSION:
            continue
        if want is not None and version.value != want:
            continue
        vp, size = ctypes.c_void_p, ctypes.c_size_t
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), ctypes.c_int, _UniqueId, ctypes.c_int]
        lib.ncclAllReduce.argtypes = [vp, vp, size, ctypes.c_int, ctypes.c_int, vp, vp]
        lib.ncclAllGather.argtypes = [vp, vp, size, ctypes.c_int, vp, vp]
        lib.ncclCommAbort.argtypes = [vp]
        return lib
    return None


class NcclComm:
    """A NCCL communicator of a process group's ranks (`create`), for collectives on the
    current stream."""

    __slots__ = ("_comm", "_lib", "device", "rank", "world_size")

    def __init__(self, lib: Any, comm: ctypes.c_void_p, device: int, rank: int, world: int) -> None:
        self._lib = lib
        self._comm = comm
        self.device = device
        self.rank = rank
        self.world_size = world

    @classmethod
    def create(cls, group: Any, device: torch.device, willing: bool = True) -> NcclComm | None:
        """A new communicator of ``group``'s ranks on CUDA ``device``, or None where some
        rank is not ``willing`` or cannot make one (no usable NCCL library there, or no unique
        id on rank 0): then on every rank. Collective: every rank of ``group`` calls it at the
        same point (two collectives of ``group``, then NCCL's initialization, which waits for
        every rank: a rank whose initialization fails raises, and the others wait until their
        `mpsnn.RankMonitor` ends them)."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        lib = _library() if willing else None
        ok = torch.tensor([1 if lib is not None else 0], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if not int(ok.item()):
            return None
        uid = _UniqueId()
        box: list[Any] = [None]
        if rank == 0:  # an empty id tells every rank that rank 0 could not make one
            got = lib.ncclGetUniqueId(ctypes.byref(uid))
            box[0] = bytes(uid.internal) if got == 0 else b""
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(box, src=src, group=group, device=device)
        if not box[0]:
            return None
        ctypes.memmove(ctypes.byref(uid), box[0], ctypes.sizeof(uid))
        comm = ctypes.c_void_p()
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.cuda.device(index):
            _check(lib, lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank),
                   "ncclCommInitRank")  # fmt: skip
        return cls(lib, comm, index, rank, world)

    @classmethod
    def shared(cls, group: Any, device: torch.device, willing: bool = True) -> NcclComm | None:
        """The communicator of ``group`` on ``device`` that `create` made for an earlier
        caller in this process, else `create`'s (collective, as `create`: every rank asks at
        the same point, and gets one where every rank got one)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        # the group object itself, the default one included: a group made again after
        # destroy_process_group is another object, and gets a communicator of its own
        key = (group if group is not None else dist.group.WORLD, index)
        comm = _SHARED.get(key)
        if comm is None:
            comm = cls.create(group, torch.device("cuda", index), willing)
            if comm is not None:
                _SHARED[key] = comm
        return comm

    def all_reduce_(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place (contiguous, on this communicator's device)."""
        self._operand(t)
        p = t.data_ptr()
        r = self._lib.ncclAllReduce(p, p, t.numel(), _DTYPES[t.dtype], _SUM, self._comm,
                                    _raw_stream(self.device))  # fmt: skip
        _check(self._lib, r, "ncclAllReduce")

    def all_gather_(self, out: torch.Tensor, t: torch.Tensor) -> None:
        """Every rank's ``t`` into ``out`` (``world_size * t.numel()`` elements), rank by
        rank."""
        self._operand(t)
        self._operand(out)
        if out.dtype != t.dtype or out.numel() != self.world_size * t.numel():
            raise ValueError(
                f"[NcclComm] all_gather_ needs out of {self.world_size} x {t.numel()} "
                f"{t.dtype} elements, got {out.numel()} {out.dtype}"
            )
        r = self._lib.ncclAllGather(t.data_ptr(), out.data_ptr(), t.numel(), _DTYPES[t.dtype],
                                    self._comm, _raw_stream(self.device))  # fmt: skip
        _check(self._lib, r, "ncclAllGather")

    def abort(self) -> None:
        """End the communicator (its pending collectives too); later calls raise."""
        if self._comm is not None:
            comm, self._comm = self._comm, None
            _check(self._lib, self._lib.ncclCommAbort(comm), "ncclCommAbort")

    def _operand(self, t: torch.Tensor) -> None:
        if self._comm is None:
            raise RuntimeError("[NcclComm] the communicator was aborted")
        if not (t.is_cuda and t.device.index == self.device and t.is_contiguous()):
            raise ValueError(
                f"[NcclComm] operands must be contiguous tensors on cuda:{self.device}, "
                f"got {'a contiguous' if t.is_contiguous() else 'a strided'} tensor on {t.device}"
            )
        if t.dtype not in _DTYPES:
            raise TypeError(f"[NcclComm] dtype must be one of NCCL's, got {t.dtype}")

    def __repr__(self) -> str:
        return f"<NcclComm rank {self.rank}/{self.world_size} on cuda:{self.device}>"


# (process group, device index) -> the communicator `shared` made
_SHARED: dict[tuple[Any, int], NcclComm] = {}


def close_all() -> None:
    """End every communicator `shared` made (after the device's work: a normal end; a
    recorded step that uses one must not be replayed after this)."""
    comms = list(_SHARED.values())
    _SHARED.clear()
    if comms:
        torch.cuda.synchronize()
    for comm in comms:
        comm.abort()


def _check(lib: Any, result: int, what: str) -> None:
    if result != 0:
        text = lib.ncclGetErrorString(result)
        raise RuntimeError(f"{what} failed: {text.decode() if text else result}")
