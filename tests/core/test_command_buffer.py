"""Devices, queues and command buffers: deferred execution, status, handlers, errors."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.helpers import DEVICES


def _conv(dev: m.Device) -> m.Convolution:
    desc = m.ConvolutionDescriptor(1, 1, 1, 1)
    return m.Convolution(dev, m.TensorConvolutionDataSource(desc, torch.full((1, 1, 1, 1), 2.0)))


def test_device_kinds_and_equality() -> None:
    cpu = m.Device("cpu")
    assert cpu == m.Device(torch.device("cpu")) and hash(cpu) == hash(m.Device("cpu"))
    assert cpu.type == "cpu" and cpu.name == "cpu"
    assert m.Device.default().type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(
        ValueError, match=r"\[Device\] kind must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"
    ):
        m.Device("tpu")
    with pytest.raises(TypeError, match=r"\[Device\] kind must be"):
        m.Device(3)
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError, match=r"\[Device\] CUDA is not available on this machine, got 'cuda'"
        ):
            m.Device("cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_encode_is_deferred_until_commit(device: str) -> None:
    dev = m.Device(device)
    conv = _conv(dev)
    x = torch.ones(1, 1, 2, 2, device=device)
    storage = torch.zeros(1, 1, 2, 2, device=device)
    dst = m.Image.from_tensor(storage)
    cb = dev.new_command_queue().command_buffer()
    conv.encode(cb, m.Image.from_tensor(x), dst)
    assert len(cb) == 1 and cb.status is m.CommandBufferStatus.NOT_ENQUEUED
    assert storage.abs().sum() == 0  # nothing ran yet
    with pytest.raises(ValueError, match=r"\[Image\] reading .* committed first, got status"):
        dst.tensor  # noqa: B018 - the read itself is what is tested
    x.fill_(3.0)  # the command reads its source when it runs
    cb.commit()
    cb.wait_until_completed()
    assert cb.status is m.CommandBufferStatus.COMPLETED
    assert torch.equal(dst.tensor.cpu(), torch.full((1, 1, 2, 2), 6.0))


@pytest.mark.parametrize("device", DEVICES)
def test_completed_handlers_run_in_order_after_the_work(device: str) -> None:
    dev = m.Device(device)
    conv = _conv(dev)
    cb = dev.new_command_queue().command_buffer()
    out = conv.encode(cb, m.Image.from_tensor(torch.ones(1, 1, 1, 1, device=device)))
    seen = []
    cb.add_completed_handler(lambda b: seen.append(("first", b.status, out.tensor.item())))
    cb.add_completed_handler(lambda b: seen.append(("second", b.status, None)))
    cb.commit()
    cb.wait_until_completed()
    assert seen == [
        ("first", m.CommandBufferStatus.COMPLETED, 2.0),
        ("second", m.CommandBufferStatus.COMPLETED, None),
    ]
    with pytest.raises(
        ValueError,
        match=r"\[CommandBuffer\] completed handlers must be added before commit\(\), got status COMPLETED",
    ):
        cb.add_completed_handler(lambda b: None)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_in_the_work_are_kept_and_reraised(device: str) -> None:
    dev = m.Device(device)
    cb = dev.new_command_queue().command_buffer()
    ran = []

    def boom() -> None:
        raise RuntimeError("device fault")

    cb.record("first", lambda: ran.append(1))
    cb.record("boom", boom)
    cb.record("after", lambda: ran.append(3))
    cb.commit()  # never raises: like Metal, errors surface on completion
    with pytest.raises(RuntimeError, match="device fault"):
        cb.wait_until_completed()
    assert cb.status is m.CommandBufferStatus.ERROR and isinstance(cb.error, RuntimeError)
    assert ran == [1]  # the work after the failure did not run
    assert any("boom" in note for note in cb.error.__notes__)


def test_a_handler_error_is_reported() -> None:
    cb = m.Device("cpu").new_command_queue().command_buffer()
    cb.add_completed_handler(lambda b: 1 / 0)
    cb.commit()
    with pytest.raises(ZeroDivisionError):
        cb.wait_until_completed()
    assert cb.status is m.CommandBufferStatus.ERROR


def test_commit_twice_and_encode_after_commit_are_errors() -> None:
    dev = m.Device("cpu")
    conv = _conv(dev)
    cb = dev.new_command_queue().command_buffer()
    cb.commit()
    with pytest.raises(
        ValueError,
        match=r"\[CommandBuffer\] a command buffer is committed once, got commit\(\) with status COMPLETED",
    ):
        cb.commit()
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] the command buffer must not be committed yet, got status COMPLETED",
    ):
        conv.encode(cb, m.Image.from_tensor(torch.ones(1, 1, 1, 1)))
    fresh = dev.new_command_queue().command_buffer()
    with pytest.raises(
        ValueError,
        match=r"\[CommandBuffer\] wait_until_completed\(\) needs a committed command buffer, got status NOT_ENQUEUED",
    ):
        fresh.wait_until_completed()
    with pytest.raises(
        TypeError, match=r"\[Convolution\] command_buffer must be a CommandBuffer, got str"
    ):
        conv.encode("cb", m.Image.from_tensor(torch.ones(1, 1, 1, 1)))


def test_reading_an_image_before_its_writer_committed_is_an_error() -> None:
    dev = m.Device("cpu")
    cb = dev.new_command_queue().command_buffer()
    y = _conv(dev).encode(cb, m.Image.from_tensor(torch.ones(1, 1, 1, 1)))
    with pytest.raises(
        ValueError,
        match=r"\[Image\] read_bytes needs the command buffer that writes Image 1x1x1x1 to be committed, got status NOT_ENQUEUED",
    ):
        y.read_bytes()
    cb.commit()
    assert y.read_bytes().item() == 2.0  # waits for the writer, then reads


def _fake_cuda_device() -> m.Device:
    """A Device naming cuda:0 without needing CUDA (only compared, never used for tensors)."""
    fake = m.Device.__new__(m.Device)
    fake._torch = torch.device("cuda", 0)
    return fake


def test_images_and_buffers_on_another_device_are_rejected() -> None:
    cpu = m.Device("cpu")
    conv = _conv(cpu)
    other = m.Image(_fake_cuda_device(), m.ImageDescriptor(m.FeatureChannelFormat.FLOAT32, 1, 1, 1))
    cb = cpu.new_command_queue().command_buffer()
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] source_image must be on the kernel's device Device\('cpu'\), got an image on Device\('cuda:0'\)",
    ):
        conv.encode(cb, other)
    with pytest.raises(
        ValueError, match=r"\[Convolution\] destination_image must be on the kernel's device"
    ):
        conv.encode(cb, m.Image.from_tensor(torch.ones(1, 1, 1, 1)), other)
    assert len(cb) == 0


def test_a_stream_needs_a_cuda_queue() -> None:
    with pytest.raises(
        ValueError, match=r"\[CommandQueue\] a stream needs a CUDA device, got one for the CPU"
    ):
        m.Device("cpu").new_command_queue(stream=object())
    assert m.Device("cpu").new_command_queue().stream is None


if torch.cuda.is_available():  # the same check with real devices, on the GPU machine

    def test_private_stream_queue_waits_for_the_callers_stream() -> None:
        dev = m.Device("cuda")
        stream = torch.cuda.Stream()
        q = dev.new_command_queue(stream=stream)
        assert q.stream is stream and dev.new_command_queue().stream == torch.cuda.current_stream()
        conv = _conv(dev)
        x = torch.zeros(64, 1, 64, 64, device="cuda")
        torch.cuda._sleep(10_000_000)  # keep the default stream busy ...
        x.fill_(1.0)  # ... so this write is still pending at commit
        cb = q.command_buffer()
        y = conv.encode(cb, m.Image.from_tensor(x))
        cb.commit()
        cb.wait_until_completed()
        assert torch.equal(y.tensor, torch.full_like(x, 2.0))

    def test_real_cross_device_images_are_rejected() -> None:
        conv = _conv(m.Device("cuda"))
        cb = m.Device("cuda").new_command_queue().command_buffer()
        with pytest.raises(ValueError, match=r"got an image on Device\('cpu'\)"):
            conv.encode(cb, m.Image.from_tensor(torch.ones(1, 1, 1, 1)))
        with pytest.raises(ValueError, match=r"the command buffer must be on Device\('cuda:0'\)"):
            conv.encode(
                m.Device("cpu").new_command_queue().command_buffer(),
                m.Image.from_tensor(torch.ones(1, 1, 1, 1, device="cuda")),
            )
