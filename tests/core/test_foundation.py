"""The training-ready foundation: accumulation decided at run time, in-place master weights,
failed work that is loud, mixed formats, destinations that are writable, command buffers
whose threads end with their queues, and encodes that change nothing when they fail."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import DEVICES, assert_close, float32_reference, run

_conv_backward = torch.ops.aten.convolution_backward.default


def _conv(dev: m.Device, cin=2, cout=3, k=3, dtype=torch.float64, seed=0, neuron=None):
    gen = torch.Generator().manual_seed(seed)
    desc = m.ConvolutionDescriptor(k, k, cin, cout, fused_neuron_descriptor=neuron)
    w = torch.randn(desc.weights_shape, generator=gen, dtype=dtype)
    b = torch.randn(cout, generator=gen, dtype=dtype)
    ds = m.TensorConvolutionDataSource(desc, w, b)
    return m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds), w, b


def _reference_grads(x, g, w_ohwi):
    w = w_ohwi.permute(0, 3, 1, 2)
    _, dw, db = _conv_backward(
        g, x, w, [w.shape[0]], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, True]
    )
    return dw.permute(0, 2, 3, 1), db


def _batch(*shape, seed, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return m.ImageBatch.from_tensor(torch.randn(*shape, generator=gen, dtype=dtype).to(device))


# -- accumulation decided when the work runs ------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_sums_do_not_depend_on_commit_order(device) -> None:
    """Encode into one state on buffers a then b, commit b first: the state holds a + b (it
    used to fail with "accumulator missing": store-or-add was decided at encode time)."""
    dev = m.Device(device)
    conv, grad, w, _ = _conv(dev)
    q = dev.new_command_queue()
    x1, x2 = _batch(2, 2, 5, 5, seed=1, device=device), _batch(2, 2, 5, 5, seed=2, device=device)
    g1, g2 = _batch(2, 3, 5, 5, seed=3, device=device), _batch(2, 3, 5, 5, seed=4, device=device)
    states = conv.result_state_batch(x1)
    a, b = q.command_buffer(), q.command_buffer()
    conv.encode_batch(a, x1, destination_states=states)
    grad.encode_batch(a, g1, x1, states)
    conv.encode_batch(b, x2, destination_states=states)
    grad.encode_batch(b, g2, x2, states)
    run(b)
    run(a)
    x = torch.cat([x1.tensor, x2.tensor]).cpu()
    g = torch.cat([g1.tensor, g2.tensor]).cpu()
    dw, db = _reference_grads(x, g, w)
    assert_close(states[0].gradient_for_weights, dw, "dW, commit order b then a")
    assert_close(states[0].gradient_for_biases, db, "db, commit order b then a")


def test_abandoned_buffers_contribute_nothing() -> None:
    """A buffer that is never committed (user code raised) neither breaks later accumulation
    nor adds anything to it."""
    dev = m.Device("cpu")
    conv, grad, w, _ = _conv(dev)
    q = dev.new_command_queue()
    x, g = _batch(2, 2, 5, 5, seed=5), _batch(2, 3, 5, 5, seed=6)
    states = conv.result_state_batch(x)
    abandoned = q.command_buffer()
    conv.encode_batch(abandoned, x, destination_states=states)
    grad.encode_batch(abandoned, _batch(2, 3, 5, 5, seed=7), x, states)
    ran = q.command_buffer()
    conv.encode_batch(ran, x, destination_states=states)
    grad.encode_batch(ran, g, x, states)
    run(ran)
    dw, db = _reference_grads(x.tensor, g.tensor, w)
    assert_close(states[0].gradient_for_weights, dw, "dW with an abandoned buffer")
    assert_close(states[0].gradient_for_biases, db, "db with an abandoned buffer")


@pytest.mark.parametrize("device", DEVICES)
def test_several_queues_sum_into_one_state(device) -> None:
    """Gradient work of one state committed on two queues (two streams on CUDA) sums."""
    dev = m.Device(device)
    conv, grad, w, _ = _conv(dev)
    stream = torch.cuda.Stream() if device == "cuda" else None
    q1, q2 = dev.new_command_queue(), dev.new_command_queue(stream=stream)
    x1, x2 = _batch(1, 2, 6, 6, seed=8, device=device), _batch(3, 2, 6, 6, seed=9, device=device)
    g1, g2 = _batch(1, 3, 6, 6, seed=10, device=device), _batch(3, 3, 6, 6, seed=11, device=device)
    states = conv.result_state_batch(x1)
    for q, x, g in ((q1, x1, g1), (q2, x2, g2)):
        cb = q.command_buffer()
        conv.encode_batch(cb, x, destination_states=states[:1] * len(x))
        grad.encode_batch(cb, g, x, states[:1] * len(x))
        cb.commit()
    for q in (q1, q2):  # wait for everything
        last = q.command_buffer()
        last.commit()
        last.wait_until_completed()
    if device == "cuda":
        torch.cuda.synchronize()
    x = torch.cat([x1.tensor, x2.tensor]).cpu()
    g = torch.cat([g1.tensor, g2.tensor]).cpu()
    dw, db = _reference_grads(x, g, w)
    assert_close(states[0].gradient_for_weights, dw, "dW over two queues")
    assert_close(states[0].gradient_for_biases, db, "db over two queues")


def test_reset_starts_a_new_sum() -> None:
    dev = m.Device("cpu")
    conv, grad, w, _ = _conv(dev)
    q = dev.new_command_queue()
    x, g = _batch(2, 2, 5, 5, seed=12), _batch(2, 3, 5, 5, seed=13)
    states = conv.result_state_batch(x)
    for _ in range(2):
        cb = q.command_buffer()
        conv.encode_batch(cb, x, destination_states=states)
        grad.encode_batch(cb, _batch(2, 3, 5, 5, seed=14), x, states)
        run(cb)
    assert states[0].has_accumulated
    states[0].reset()
    assert not states[0].has_accumulated
    cb = q.command_buffer()
    conv.encode_batch(cb, x, destination_states=states)
    grad.encode_batch(cb, g, x, states)
    run(cb)
    dw, db = _reference_grads(x.tensor, g.tensor, w)
    assert_close(states[0].gradient_for_weights, dw, "dW after reset")
    assert_close(states[0].gradient_for_biases, db, "db after reset")


# -- master weights, updated in place --------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_in_place_weight_changes_reach_every_storage_format(device, dtype) -> None:
    """A reload from the data source changes float16/bfloat16 outputs too (their weight copies
    are rewritten with the masters), and a command-buffer reload writes into the same master
    tensor."""
    dev = m.Device(device)
    conv, _, w, b = _conv(dev, dtype=torch.float32, seed=20)
    q = dev.new_command_queue()
    x = _batch(2, 2, 5, 5, seed=21, dtype=dtype, device=device)
    cb = q.command_buffer()
    before = conv.encode_batch(cb, x)
    run(cb)
    assert before.tensor.abs().sum() > 0
    master = conv.weights.data_ptr()
    conv.data_source.set_weights_and_biases(torch.zeros_like(w), b)
    conv.reload_weights_and_biases_from_data_source()
    cb = q.command_buffer()
    after = conv.encode_batch(cb, x)
    run(cb)
    want = b.to(dtype).float().view(1, -1, 1, 1).expand(2, 3, 5, 5)
    assert torch.equal(after.tensor.float().cpu(), want), "stale low-precision weights"
    # reload on the command buffer: recorded work, into the same master storage
    new_w = torch.full(conv.weights.shape, 0.5, device=dev.torch_device)
    state = m.ConvolutionWeightsAndBiasesState(new_w, torch.zeros(3, device=dev.torch_device))
    cb = q.command_buffer()
    conv.reload_weights_and_biases(cb, state)
    reloaded = conv.encode_batch(cb, x)
    run(cb)
    assert conv.weights.data_ptr() == master
    assert torch.equal(conv.weights.cpu(), new_w.cpu())
    with float32_reference():  # on CUDA, PyTorch's default would be TF32
        ref = F.conv2d(x.tensor.float(), new_w.permute(0, 3, 1, 2).float(), None, padding=1)
    assert_close(reloaded.tensor.float(), ref, "after a command-buffer reload", dtype=dtype)


def test_command_buffer_reload_is_recorded_work() -> None:
    """Work encoded before the reload on the same buffer reads the old weights; after, the
    new ones; nothing changes before the buffer runs."""
    dev = m.Device("cpu")
    conv, _, w, b = _conv(dev, dtype=torch.float32, seed=22)
    x = _batch(1, 2, 4, 4, seed=23, dtype=torch.float32)
    cb = dev.new_command_queue().command_buffer()
    old = conv.encode(cb, x.image)
    state = m.ConvolutionWeightsAndBiasesState(torch.zeros_like(conv.weights), torch.zeros(3))
    conv.reload_weights_and_biases(cb, state)
    assert torch.equal(conv.weights, w.float())  # not yet: it is recorded work
    new = conv.encode(cb, x.image)
    run(cb)
    ref = F.conv2d(x.tensor, w.float().permute(0, 3, 1, 2), b.float(), padding=1)
    assert_close(old.tensor, ref, "before the reload")
    assert torch.equal(new.tensor, torch.zeros_like(new.tensor))


# -- failed work is loud ----------------------------------------------------------------


def _boom() -> None:
    raise RuntimeError("the device ran out of patience")


@pytest.mark.parametrize("device", DEVICES)
def test_reading_any_image_of_a_failed_buffer_raises_naming_the_command(device) -> None:
    dev = m.Device(device)
    conv, _, _, _ = _conv(dev, dtype=torch.float32)
    x = _batch(1, 2, 4, 4, seed=24, dtype=torch.float32, device=device)
    cb = dev.new_command_queue().command_buffer(label="step")
    first = conv.encode(cb, x.image)
    cb.record("my update", _boom)
    second = conv.encode(cb, x.image)
    cb.commit()  # no wait: the read itself must notice
    for image in (first, second):
        for read in (lambda im: im.numpy(), lambda im: im.tensor, lambda im: im.read_bytes()):
            with pytest.raises(m.CommandBufferError, match=r"command 'my update' failed") as err:
                read(image)
            assert isinstance(err.value.__cause__, RuntimeError)
    assert cb.failed_command == "my update"
    with pytest.raises(RuntimeError, match="ran out of patience"):
        cb.wait_until_completed()
    assert cb.status is m.CommandBufferStatus.ERROR


# -- mixed formats ----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_gradient_and_source_formats_compute_in_the_wider_one(device) -> None:
    """A float16 gradient with a float32 source image (it used to fail at run time): the
    result, in the gradient's format, is the float32 computation rounded once."""
    dev = m.Device(device)
    conv, grad, _, _ = _conv(dev, dtype=torch.float32, seed=25)
    x = _batch(2, 2, 5, 5, seed=26, dtype=torch.float32, device=device)
    g32 = _batch(2, 3, 5, 5, seed=27, dtype=torch.float32, device=device)
    g16 = m.ImageBatch.from_tensor(g32.tensor.half())
    q = dev.new_command_queue()
    outs = {}
    for name, g in (("f32", m.ImageBatch.from_tensor(g16.tensor.float())), ("f16", g16)):
        st = conv.result_state_batch(x)
        cb = q.command_buffer()
        conv.encode_batch(cb, x, destination_states=st)
        outs[name] = grad.encode_batch(cb, g, x, st)
        run(cb)
    assert outs["f16"].tensor.dtype == torch.float16
    assert torch.equal(outs["f16"].tensor, outs["f32"].tensor.half())
    # the same holds for a pointwise family and a pooling family
    pool, pool_grad = m.PoolingMax(dev, 2, 2, 2, 2), m.PoolingMaxGradient(dev, 2, 2, 2, 2)
    st = pool.result_state_batch(x)
    cb = q.command_buffer()
    y = pool.encode_batch(cb, x, destination_states=st)
    gp = _batch(*y.shape, seed=28, dtype=torch.float32, device=device)
    half = pool_grad.encode_batch(cb, m.ImageBatch.from_tensor(gp.tensor.half()), x, st)
    full = pool_grad.encode_batch(cb, m.ImageBatch.from_tensor(gp.tensor.half().float()), x, st)
    run(cb)
    assert torch.equal(half.tensor, full.tensor.half())


# -- destinations -------------------------------------------------------------------------


def test_expanded_destinations_are_refused_at_encode() -> None:
    dev = m.Device("cpu")
    conv, grad, _, _ = _conv(dev, dtype=torch.float32)
    x = m.Image.from_tensor(torch.randn(1, 2, 4, 4))
    cb = dev.new_command_queue().command_buffer()
    expanded = m.Image.from_tensor(torch.zeros(1, 3, 1, 1).expand(1, 3, 4, 4))
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] destination_image must have one memory location per element "
        r"\(not an expanded or overlapping tensor\), got strides \(3, 1, 0, 0\)",
    ):
        conv.encode(cb, x, expanded)
    st = conv.result_state(x)
    y = conv.encode(cb, x, destination_state=st)
    g = m.Image.from_tensor(torch.randn(1, 3, 4, 4))
    with pytest.raises(ValueError, match=r"\[ConvolutionGradient\] destination_gradient must have"):
        grad.encode(cb, g, x, st, m.Image.from_tensor(torch.zeros(1, 1, 4, 1).expand(1, 2, 4, 4)))
    assert len(cb) == 1 and y is not None


# -- command buffers and their threads ------------------------------------------------------


def _worker_threads() -> int:
    return sum(t.name.startswith("mpsnn-completion") for t in threading.enumerate())


def test_cpu_queues_start_no_threads() -> None:
    dev = m.Device("cpu")
    before = threading.active_count()
    calls = []
    for _ in range(50):
        cb = dev.new_command_queue().command_buffer()
        cb.add_completed_handler(lambda c: calls.append(c.status))
        cb.commit()
    assert threading.active_count() == before
    assert calls == [m.CommandBufferStatus.COMPLETED] * 50


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA queues only")
def test_cuda_completion_threads_end_with_their_queues() -> None:
    dev = m.Device("cuda")
    base = _worker_threads()
    x = torch.randn(64, device="cuda")
    # no handlers: no thread at all
    for _ in range(50):
        cb = dev.new_command_queue().command_buffer()
        cb.record("touch", lambda: x.mul_(1.0))
        cb.commit()
        cb.wait_until_completed()
    assert _worker_threads() == base
    seen = []
    for _ in range(50):
        q = dev.new_command_queue()
        cb = q.command_buffer()
        cb.record("touch", lambda: x.mul_(1.0))
        cb.add_completed_handler(lambda c: seen.append(c.status))
        cb.commit()
        cb.wait_until_completed()
    del q, cb
    gc.collect()
    for _ in range(200):  # the workers were told to stop; give them a moment
        if _worker_threads() == base:
            break
        threading.Event().wait(0.01)
    assert _worker_threads() == base
    assert seen == [m.CommandBufferStatus.COMPLETED] * 50


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA queues only")
def test_cuda_status_is_observed_without_a_thread() -> None:
    dev = m.Device("cuda")
    cb = dev.new_command_queue().command_buffer()
    cb.record("touch", lambda: torch.ones(4, device="cuda"))
    cb.commit()
    torch.cuda.synchronize()
    assert cb.status is m.CommandBufferStatus.COMPLETED


# -- a failed encode changes nothing --------------------------------------------------------


def test_failed_encodes_leave_kernels_unchanged() -> None:
    dev = m.Device("cpu")
    x = m.Image.from_tensor(torch.randn(1, 2, 6, 6))
    q = dev.new_command_queue()
    # Dropout: a refused encode draws no mask (the next encode gets the first encode's mask)
    drop, fresh = m.Dropout(dev, 0.5, seed=3), m.Dropout(dev, 0.5, seed=3)
    cb = q.command_buffer()
    with pytest.raises(ValueError):
        drop.encode(cb, x, m.Image.from_tensor(torch.zeros(1, 1, 6, 6)))
    a, b = drop.encode(cb, x), fresh.encode(cb, x)
    run(cb)
    assert torch.equal(a.tensor, b.tensor)
    # ConvolutionTranspose: the policy sets offset and kernel offsets only when the encode holds
    desc = m.ConvolutionDescriptor(3, 3, 2, 2, stride_in_pixels_x=2, stride_in_pixels_y=2)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape))
    t = m.ConvolutionTranspose(dev, ds)
    t.kernel_offset_x, t.offset = 5, m.Offset(1, 1, 0)
    cb = q.command_buffer()
    with pytest.raises(ValueError):
        t.encode(cb, m.Image.from_tensor(torch.randn(1, 3, 4, 4)))  # 3 channels, wants 2
    assert (t.kernel_offset_x, t.offset) == (5, m.Offset(1, 1, 0)) and len(cb) == 0
    t.encode(cb, m.Image.from_tensor(torch.randn(1, 2, 4, 4)))
    assert t.offset == m.Offset(0, 0, 0) and t.kernel_offset_x != 5


def test_changed_properties_are_never_served_a_stale_plan() -> None:
    """Plans are cached per configuration: a property changed after an encode (here the zero
    pad of an average pooling, which the old cache key missed) gives a new plan."""
    dev = m.Device("cpu")
    x = m.Image.from_tensor(torch.ones(1, 1, 4, 4, dtype=torch.float64))
    pool = m.PoolingAverage(dev, 3, 3)
    pool.edge_mode = m.EdgeMode.CLAMP
    q = dev.new_command_queue()
    cb = q.command_buffer()
    plain = pool.encode(cb, x)
    run(cb)
    pool.zero_pad_size_x = pool.zero_pad_size_y = 1
    cb = q.command_buffer()
    padded = pool.encode(cb, x)
    run(cb)
    assert plain.tensor[0, 0, 0, 0].item() == 1.0  # CLAMP: the window shrinks to the image
    assert padded.tensor[0, 0, 0, 0].item() == pytest.approx(4 / 9)  # a zero border counts


def test_image_numpy_of_a_completed_buffer_still_reads() -> None:
    dev = m.Device("cpu")
    conv, _, _, _ = _conv(dev, dtype=torch.float32)
    x = m.Image.from_tensor(torch.randn(1, 2, 4, 4))
    cb = dev.new_command_queue().command_buffer()
    y = conv.encode(cb, x)
    run(cb)
    assert isinstance(y.numpy(), np.ndarray) and y.numpy().shape == (1, 3, 4, 4)
