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


def test_direct_nccl_must_be_a_bool(one_rank: None) -> None:
    with pytest.raises(TypeError, match=r"\[DataParallel\] direct_nccl must be a bool, got str"):
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


def test_every_supported_dtype_has_nccl_s_code() -> None:
    # nccl.h: ncclInt8 0, ncclUint8 1, ncclInt32 2, ncclInt64 4, ncclFloat16 6, ncclFloat32 7,
    # ncclFloat64 8, ncclBfloat16 9
    assert nccl._DTYPES[torch.float32] == 7 and nccl._DTYPES[torch.bfloat16] == 9
    assert nccl._DTYPES[torch.float64] == 8 and nccl._DTYPES[torch.int64] == 4
    assert len(set(nccl._DTYPES.values())) == len(nccl._DTYPES)


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
