"""The direct NCCL communicator (`mpsnn.distributed.nccl`) and when `DataParallel` uses it:
the choice and its refusals here (one process, Gloo); the collectives themselves on two GPUs
(`test_data_parallel.test_nccl_steps_replayed_with_their_collectives_equal_eager_steps`: its
compiled step's collectives go this way, its eager step's through torch.distributed, and the
weights are equal bit for bit)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import mpsnn as m
from mpsnn.distributed import nccl


def test_direct_nccl_must_be_a_bool_or_none(one_rank: None) -> None:
    with pytest.raises(TypeError, match=r"\[DataParallel\] direct_nccl must be a bool or None, "
                                        r"got str"):  # fmt: skip
        m.DataParallel(direct_nccl="yes")


def test_gloo_cpu_tensors_and_the_switch_keep_torch_distributed(one_rank: None) -> None:
    dp = m.DataParallel()
    assert dp._direct is None  # undecided until a CUDA collective
    assert dp._comm(torch.zeros(3)) is None and dp._direct is None  # CPU: not a NCCL operand
    meta = torch.zeros(3, device="meta")
    dp.backend, dp.world_size = "gloo", 2
    cuda_like = SimpleNamespace(is_cuda=True, device=meta.device)
    assert dp._comm(cuda_like) is None and dp._direct is False  # decided: Gloo
    off = m.DataParallel(direct_nccl=False)
    assert off._direct is False and off._comm(cuda_like) is None
    assert off.program_settings() != dp.program_settings()  # a change lowers the step again


def test_no_library_anywhere_makes_no_communicator(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank without a usable NCCL library: every rank learns it (an all-reduce of the
    ranks' answers) and none makes a communicator."""
    monkeypatch.setattr(nccl, "_candidates", lambda: ["/nonexistent/libnccl.so.2"])
    nccl._library.cache_clear()
    try:
        assert nccl._library() is None
        assert nccl.NcclComm.create(None, torch.device("cpu")) is None
    finally:
        nccl._library.cache_clear()


class _Lib:
    """What `NcclComm` calls of the library, recorded (no GPU needed)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def ncclAllReduce(self, *args):
        self.calls.append(("all_reduce", *args))
        return 0

    def ncclAllGather(self, *args):
        self.calls.append(("all_gather", *args))
        return 3  # ncclInternalError

    def ncclGetErrorString(self, code):
        return b"internal error - please report this issue to the NCCL developers"

    def ncclCommAbort(self, comm):
        self.calls.append(("abort", comm))
        return 0


def test_operands_are_checked_before_nccl_sees_them() -> None:
    lib = _Lib()
    comm = nccl.NcclComm(lib, "comm", 0, 0, 2)
    with pytest.raises(ValueError, match=r"\[NcclComm\] operands must be contiguous tensors on "
                                         r"cuda:0, got a contiguous tensor on cpu"):  # fmt: skip
        comm.all_reduce_(torch.zeros(4))
    assert lib.calls == []
    assert "rank 0/2 on cuda:0" in repr(comm)
    comm.abort()
    comm.abort()  # once
    assert lib.calls == [("abort", "comm")]
    with pytest.raises(RuntimeError, match=r"\[NcclComm\] the communicator was aborted"):
        comm.all_reduce_(torch.zeros(4))


def test_nccl_failures_raise_with_nccl_s_message() -> None:
    lib = _Lib()
    with pytest.raises(RuntimeError, match="ncclAllGather failed: internal error"):
        nccl._check(lib, lib.ncclAllGather(), "ncclAllGather")
    nccl._check(lib, 0, "ncclAllReduce")  # success: nothing


class _FakeCDLL:
    """A library that reports ``version`` (what `_library` asks before anything else)."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.ncclGetErrorString = SimpleNamespace()
        self.ncclCommInitRank = SimpleNamespace()
        self.ncclAllReduce = SimpleNamespace()
        self.ncclAllGather = SimpleNamespace()
        self.ncclCommAbort = SimpleNamespace()

    def ncclGetVersion(self, ref) -> int:
        ref._obj.value = self.version
        return 0


@pytest.mark.parametrize(
    ("found", "torch_has", "usable"),
    [(21000, None, True), (20903, None, False), (22809, 22809, True), (22807, 22809, False)],
    ids=["2.10", "older than 2.10", "pytorch's version", "another version than pytorch's"],
)
def test_the_library_must_be_new_enough_and_pytorch_s_own(
    monkeypatch: pytest.MonkeyPatch, found: int, torch_has: int | None, usable: bool
) -> None:
    monkeypatch.setattr(nccl, "_candidates", lambda: ["fake"])
    monkeypatch.setattr(nccl.ctypes, "CDLL", lambda path: _FakeCDLL(found))
    monkeypatch.setattr(nccl, "_torch_version", lambda: torch_has)
    nccl._library.cache_clear()
    try:
        lib = nccl._library()
        assert (lib is not None) == usable
        if usable:  # the signatures were set
            assert lib.ncclAllReduce.argtypes[2] is nccl.ctypes.c_size_t
    finally:
        nccl._library.cache_clear()


def _nccl_dp() -> m.DataParallel:
    dp = m.DataParallel()
    dp.backend, dp.world_size = "nccl", 2  # as on a two-rank NCCL group
    return dp


_CUDA_LIKE = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


def test_no_communicator_is_made_during_a_capture(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(nccl.NcclComm, "shared", classmethod(lambda c, g, d, w: made.append(d)))
    dp = _nccl_dp()
    assert dp._comm(_CUDA_LIKE) is None and dp._direct is None  # decided later
    assert made == []


def test_the_communicator_is_made_once_then_kept(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = []
    comm = object()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(nccl.NcclComm, "shared",
                        classmethod(lambda c, g, d, w: made.append(d) or comm))  # fmt: skip
    dp = _nccl_dp()
    assert dp._comm(_CUDA_LIKE) is comm and dp._comm(_CUDA_LIKE) is comm
    assert made == [_CUDA_LIKE.device]


@pytest.mark.parametrize("outcome", ["refused", "raised"])
def test_a_refused_or_failed_communicator_is_not_asked_for_again(
    one_rank: None, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    made = []

    def shared(cls, group, device, willing):
        made.append(device)
        if outcome == "raised":
            raise RuntimeError("ncclCommInitRank failed: unhandled system error")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(nccl.NcclComm, "shared", classmethod(shared))
    dp = _nccl_dp()
    if outcome == "raised":
        with pytest.raises(m.DistributedError, match=r"\[DataParallel\] making the direct NCCL "
                           r"communicator failed on rank 0: ncclCommInitRank failed"):  # fmt: skip
            dp._comm(_CUDA_LIKE)
    else:
        assert dp._comm(_CUDA_LIKE) is None
    assert dp._direct is False
    assert dp._comm(_CUDA_LIKE) is None and len(made) == 1


def test_the_critical_path_collectives_take_the_communicator(one_rank: None) -> None:
    calls = []

    class Comm:
        def all_reduce_(self, t):
            calls.append(("all_reduce_", t))
            t.mul_(2)

        def all_gather_(self, out, t):
            calls.append(("all_gather_", t))
            out.copy_(torch.cat([t, t]))

    dp = _nccl_dp()
    asked = []
    dp._comm = lambda t: asked.append(t) or Comm()
    flat = torch.ones(3)
    dp._sum_now("the sums", flat)
    assert calls == [("all_reduce_", flat)] and torch.equal(flat, torch.full((3,), 2.0))
    rows = dp._all_gather("the statistics", torch.arange(3.0))
    assert calls[1][0] == "all_gather_" and rows.shape == (2, 3)
    assert torch.equal(rows[1], torch.arange(3.0))
    strided = torch.arange(6.0)[::2]
    dp.world_size = 1  # (the process group's own path, on this one-rank group)
    dp._all_gather("strided values", strided)
    assert len(asked) == 2  # a strided tensor is not offered to the communicator


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA tensor")
def test_a_strided_or_mis_sized_operand_is_refused_on_cuda() -> None:
    lib = _Lib()
    comm = nccl.NcclComm(lib, "comm", torch.cuda.current_device(), 0, 2)
    t = torch.zeros(4, 4, device="cuda")
    with pytest.raises(ValueError, match="got a strided tensor"):
        comm.all_reduce_(t[:, ::2])
    with pytest.raises(ValueError, match=r"needs out of 2 x 4 .* got 4"):
        comm.all_gather_(torch.zeros(4, device="cuda"), t[0])
    with pytest.raises(TypeError, match="dtype must be one of NCCL's"):
        comm.all_reduce_(torch.zeros(2, dtype=torch.complex64, device="cuda"))
    comm.all_reduce_(t)
    (call,) = lib.calls
    assert call[:7] == ("all_reduce", t.data_ptr(), t.data_ptr(), 16, 7, 0, "comm")


@pytest.mark.parametrize(
    ("setting", "monitored", "willing"),
    [(None, False, False), (None, True, True), (True, False, True)],
    ids=["default, no monitor", "default, a monitor", "forced"],
)
def test_by_default_only_a_monitored_rank_wants_the_communicator(
    one_rank: None, monkeypatch: pytest.MonkeyPatch, setting, monitored, willing
) -> None:
    """Nothing but a rank's monitor ends it when a direct collective's peer is gone (the
    process group's timeout does not watch them): by default a rank without one says no,
    in the decision every rank takes part in."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(nccl.NcclComm, "shared",
                        classmethod(lambda c, g, d, w: asked.append(w)))  # fmt: skip
    monitor = SimpleNamespace(progress=lambda: None) if monitored else None
    dp = m.DataParallel(direct_nccl=setting, monitor=monitor)
    dp.backend, dp.world_size = "nccl", 2
    assert dp._comm(_CUDA_LIKE) is None  # (the patched decision made none)
    assert asked == [willing]


def test_an_unwilling_rank_makes_no_communicator(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_library_lookup():
        raise AssertionError("an unwilling rank does not look for NCCL")

    monkeypatch.setattr(nccl, "_library", no_library_lookup)
    assert nccl.NcclComm.create(None, torch.device("cpu"), willing=False) is None


def test_only_made_communicators_are_shared(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = iter([None, "comm"])
    calls = []

    def create(cls, group, device, willing=True):
        calls.append(willing)
        return next(made)

    monkeypatch.setattr(nccl.NcclComm, "create", classmethod(create))
    monkeypatch.setattr(nccl, "_SHARED", {})
    device = torch.device("cuda", 0)
    assert nccl.NcclComm.shared(None, device, False) is None  # refused: not kept
    assert nccl.NcclComm.shared(None, device, True) == "comm"
    assert nccl.NcclComm.shared(None, device, True) == "comm"  # kept
    assert calls == [False, True]
