"""Memory that cannot be allocated: images, temporary images, batches and kernels' results
raise `mpsnn.AllocationError` (a `MemoryError`, and PyTorch's ``OutOfMemoryError``) naming
the sizes, dtype, byte size and device, quickly. The sizes here exceed any process's address
space (over 64 PiB), so the allocator refuses them at once, without touching memory, even on
hosts that overcommit memory (where a mere terabyte may be granted, then filled)."""

from __future__ import annotations

import time

import pytest
import torch

import mpsnn as m
from mpsnn.core.allocation import allocation_error, byte_size, is_allocation_failure
from tests.helpers import run

F32 = m.FeatureChannelFormat.FLOAT32
CPU = m.Device("cpu")
# 32768 x 256 x 65536 x 65536 float32: 2^57 bytes
HUGE = m.ImageDescriptor(F32, 65536, 65536, 256, 32768)
HUGE_TEXT = r"32768 x 256 x 65536 x 65536 float32 \(128\.00 PiB\) on cpu"
RAW = r"can't allocate memory"


def test_an_image_too_large_to_allocate_names_its_size() -> None:
    start = time.perf_counter()
    image = m.Image(CPU, HUGE)
    with pytest.raises(m.AllocationError, match=rf"^\[Image\] cannot allocate {HUGE_TEXT}: ") as e:
        image.tensor  # noqa: B018 (the storage is allocated at first use)
    assert time.perf_counter() - start < 5
    assert isinstance(e.value, MemoryError) and isinstance(e.value, torch.OutOfMemoryError)
    assert isinstance(e.value.__cause__, RuntimeError) and RAW in str(e.value.__cause__)
    assert RAW in str(e.value) and "enforce fail" not in str(e.value)
    labelled = m.Image(CPU, HUGE, label="huge")
    with pytest.raises(m.AllocationError, match=rf"^\[Image\] cannot allocate 'huge', {HUGE_TEXT}"):
        labelled.numpy()


def test_a_temporary_image_and_a_batch_too_large_name_their_sizes() -> None:
    cb = CPU.new_command_queue().command_buffer()
    tmp = m.TemporaryImage.from_descriptor(cb, HUGE)
    with pytest.raises(
        m.AllocationError, match=rf"^\[TemporaryImage\] cannot allocate {HUGE_TEXT}"
    ):
        tmp._data()
    one = m.ImageDescriptor(F32, 65536, 65536, 256, 16384)
    with pytest.raises(
        m.AllocationError,
        match=r"^\[Image\] cannot allocate 16384 x 256 x 65536 x 65536 float32 "
        r"\(64\.00 PiB\) on cpu",
    ):
        m.ImageBatch.from_images([m.Image(CPU, one) for _ in range(2)])
    with pytest.raises(m.AllocationError, match=rf"^\[Image\] cannot allocate {HUGE_TEXT}"):
        m.ImageBatch(m.Image(CPU, HUGE)).numpy()


def test_a_kernel_whose_result_cannot_be_allocated_names_it() -> None:
    """An upsampling of a small image to 2^27 x 2^27 pixels: the kernel's result (256 PiB)
    does not fit; the command's error names the kernel and the result."""
    x = m.Image.from_tensor(torch.randn(1, 4, 4, 4))
    up = m.UpsamplingNearest(CPU, 2**25, 2**25)
    cb = CPU.new_command_queue().command_buffer()
    y = up.encode(cb, x)
    assert y.shape == (1, 4, 2**27, 2**27)
    start = time.perf_counter()
    with pytest.raises(
        m.AllocationError,
        match=r"^\[UpsamplingNearest\] cannot allocate its result, 1 x 4 x 134217728 x "
        r"134217728 float32 \(256\.00 PiB\) on cpu: .*can't allocate memory",
    ):
        run(cb)
    assert time.perf_counter() - start < 5
    with pytest.raises(m.CommandBufferError) as e:  # reading the result says what failed
        y.tensor  # noqa: B018
    assert isinstance(e.value.__cause__, m.AllocationError)


def test_a_convolution_of_a_source_too_large_names_the_source() -> None:
    desc = m.ConvolutionDescriptor(3, 3, 256, 4)
    conv = m.Convolution(CPU, m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape)))
    cb = CPU.new_command_queue().command_buffer()
    conv.encode(cb, m.Image(CPU, HUGE, label="photos"))
    with pytest.raises(
        m.AllocationError, match=rf"^\[Image\] cannot allocate 'photos', {HUGE_TEXT}"
    ):
        run(cb)


def test_only_allocator_failures_are_rewritten() -> None:
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 4398046511104 bytes. Error code 12 (Cannot allocate memory)"
    )
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 TiB.")
    for exc in (cpu, cuda, MemoryError()):
        assert is_allocation_failure(exc), exc
    for exc in (RuntimeError("shape mismatch"), ValueError("can't allocate memory")):
        assert not is_allocation_failure(exc), exc
    err = allocation_error("Image", [(1, 1, 2**20, 2**20)], torch.float16, "cuda:0", cuda)
    assert not is_allocation_failure(err)  # already rewritten: kept as it is
    assert str(err) == (
        "[Image] cannot allocate 1 x 1 x 1048576 x 1048576 float16 (2.00 TiB) on cuda:0: "
        "CUDA out of memory. Tried to allocate 4.00 TiB."
    )
    assert str(allocation_error("Image", [(2, 3)], torch.uint8, "cpu", cpu)) == (
        "[Image] cannot allocate 2 x 3 uint8 (6 B) on cpu: DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 4398046511104 bytes. Error code 12 (Cannot allocate memory)"
    )


def test_a_failure_that_is_not_an_allocation_stays_as_it_was(monkeypatch) -> None:
    x = m.Image.from_tensor(torch.randn(1, 1, 4, 4))
    up = m.UpsamplingNearest(CPU, 2, 2)
    cb = CPU.new_command_queue().command_buffer()
    up.encode(cb, x)

    def broken(*args, **kwargs):
        raise RuntimeError("not about memory")

    monkeypatch.setattr(torch.nn.functional, "interpolate", broken)
    with pytest.raises(RuntimeError, match="not about memory") as e:
        run(cb)
    assert not isinstance(e.value, m.AllocationError)


def test_byte_sizes_read_in_binary_units() -> None:
    assert [byte_size(n) for n in (0, 1023, 1024, 1536 * 1024, 1440000000000)] == [
        "0 B",
        "1023 B",
        "1.00 KiB",
        "1.50 MiB",
        "1.31 TiB",
    ]
