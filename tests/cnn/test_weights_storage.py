"""Convolution weights as storage the client holds: what a `ConvolutionWeightsAndBiasesState`
and a `TensorConvolutionDataSource` wrap (same memory as the client's tensors) and what they
copy, and data sources whose ``weights()`` are flat buffers (MPS's weights pointer).

An OHWI tensor that is contiguous is, read as OIHW (``w.permute(0, 3, 1, 2)``), a tensor in
channels-last memory: the state keeps exactly that view, and its readers (reloads, every
optimizer) work on it in place."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import mpsnn as m
from tests.helpers import assert_close, run

CPU = m.Device("cpu")
F64 = torch.float64


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
    )


# -- ConvolutionWeightsAndBiasesState(weights, biases) wraps ---------------------------------


def test_state_wraps_the_clients_tensors() -> None:
    """initWithWeights:biases: the state's weights and biases are the client's memory, both
    ways: a write by the client shows in the state, a write into the state in the client's
    tensors. The OIHW storage the readers see is the channels-last view of the OHWI tensor."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, 3, 2, generator=gen)
    b = torch.randn(4, generator=gen)
    st = m.ConvolutionWeightsAndBiasesState(w, b)
    assert _same_storage(st.weights, w) and _same_storage(st.biases, b)
    assert st._oihw.is_contiguous(memory_format=torch.channels_last)
    assert st._oihw.data_ptr() == w.data_ptr()
    w[0, 1, 2, 1] = 5.0
    assert st.weights[0, 1, 2, 1].item() == 5.0
    st.weights.mul_(2.0)
    st.biases.add_(1.0)
    assert w[0, 1, 2, 1].item() == 10.0 and torch.equal(b, st.biases)


def test_state_wraps_an_ohwi_view_of_oihw_storage_as_contiguous_oihw() -> None:
    """The other dense layout: OHWI given as a view of OIHW memory (``oihw.permute(0, 2, 3,
    1)``, what mpsnn.models hands its data sources) is wrapped as contiguous OIHW."""
    oihw = torch.randn(4, 2, 3, 3)
    st = m.ConvolutionWeightsAndBiasesState(oihw.permute(0, 2, 3, 1))
    assert st._oihw.is_contiguous() and st._oihw.data_ptr() == oihw.data_ptr()


def test_state_wraps_a_tensor_that_requires_grad_through_detach() -> None:
    """A leaf that requires grad is wrapped (its storage, detached: the state's writes are
    not recorded by autograd, as torch.optim's are not)."""
    w = torch.randn(2, 1, 1, 3, requires_grad=True)
    st = m.ConvolutionWeightsAndBiasesState(w)
    assert _same_storage(st.weights, w) and not st.weights.requires_grad
    st.weights.fill_(0.5)
    assert torch.equal(w.detach(), torch.full((2, 1, 1, 3), 0.5))


def test_state_copies_weights_it_cannot_wrap_and_says_which() -> None:
    """Copies: weights whose memory has gaps or overlaps (a strided slice, an expanded tensor)
    get fresh contiguous OIHW storage; biases of another dtype or with gaps are copied in the
    weights' dtype. Everything else in the same state is still wrapped."""
    base = torch.randn(4, 3, 3, 4, dtype=F64)
    sliced = base[:, :, :, ::2]  # gaps
    b = torch.randn(4, dtype=F64)
    st = m.ConvolutionWeightsAndBiasesState(sliced, b)
    assert st._oihw.is_contiguous() and st.weights.data_ptr() != base.data_ptr()
    assert torch.equal(st.weights, sliced) and _same_storage(st.biases, b)  # biases wrapped
    expanded = torch.randn(1, 3, 3, 2).expand(4, 3, 3, 2)  # overlaps
    st = m.ConvolutionWeightsAndBiasesState(expanded)
    assert st._oihw.is_contiguous() and torch.equal(st.weights, expanded)
    w = torch.randn(4, 3, 3, 2, dtype=F64)
    b32 = torch.randn(4)
    st = m.ConvolutionWeightsAndBiasesState(w, b32)
    assert _same_storage(st.weights, w)
    assert st.biases.dtype == F64 and st.biases.data_ptr() != b32.data_ptr()
    assert torch.equal(st.biases, b32.double())
    strided = torch.randn(8, dtype=F64)[::2]
    st = m.ConvolutionWeightsAndBiasesState(w, strided)
    assert st.biases.is_contiguous() and torch.equal(st.biases, strided)
    assert _same_storage(st.weights, w)
    with torch.inference_mode():  # inference tensors cannot be written outside that mode
        frozen = torch.randn(4, 3, 3, 2, dtype=F64)
    st = m.ConvolutionWeightsAndBiasesState(frozen, b)
    assert not st.weights.is_inference() and torch.equal(st.weights, frozen)
    st.weights.add_(1.0)  # its own memory: writable
    # states mpsnn makes own fresh storage: zeros contiguous OIHW, exports in the kernel's
    # masters' memory order (OHWI memory for the CPU's float32 convolutions, OIHW for float64)
    desc = m.ConvolutionDescriptor(3, 3, 2, 4)
    st = m.ConvolutionWeightsAndBiasesState.from_descriptor(CPU, desc)
    assert st._oihw.is_contiguous() and st.weights.shape == (4, 3, 3, 2)
    assert not st.weights.any() and not st.biases.any()  # zeros (an export is not filled first)
    w = torch.randn(desc.weights_shape)
    conv = m.Convolution(CPU, m.TensorConvolutionDataSource(desc, w))
    cb = CPU.new_command_queue().command_buffer()
    exported = conv.export_weights_and_biases(cb)
    run(cb)
    assert exported.weights.is_contiguous() and torch.equal(exported.weights, w)  # OHWI memory
    assert exported.weights.data_ptr() not in (w.data_ptr(), conv.weights.data_ptr())
    conv64 = m.Convolution(CPU, m.TensorConvolutionDataSource(desc, w.double()))
    exported = conv64.export_weights_and_biases(cb := CPU.new_command_queue().command_buffer())
    run(cb)
    assert exported._oihw.is_contiguous() and torch.equal(exported.weights, w.double())


def test_state_refuses_integer_weights() -> None:
    with pytest.raises(
        TypeError,
        match=r"\[ConvolutionWeightsAndBiasesState\] weights must hold floating-point values, "
        r"got torch.int64",
    ):
        m.ConvolutionWeightsAndBiasesState(torch.zeros(2, 1, 1, 1, dtype=torch.int64))


# -- kernels read a wrapped (channels-last) state ---------------------------------------------


_KINDS: list[tuple[type, m.ConvolutionDescriptor, tuple[int, int]]] = [
    (m.Convolution, m.ConvolutionDescriptor(3, 2, 3, 4, 2, 1, 1, 2, 1), (7, 9)),
    (m.Convolution, m.ConvolutionDescriptor(3, 3, 4, 4, groups=2), (6, 6)),
    (m.FullyConnected, m.ConvolutionDescriptor(3, 2, 3, 5), (2, 3)),
    (m.ConvolutionTranspose, m.ConvolutionDescriptor(3, 3, 3, 2, 2, 2), (4, 5)),
]


@pytest.mark.parametrize(("kind", "desc", "hw"), _KINDS, ids=lambda v: getattr(v, "__name__", ""))
def test_a_wrapped_channels_last_state_reloads_into_every_kernel_exactly(
    kind: type, desc: m.ConvolutionDescriptor, hw: tuple[int, int]
) -> None:
    """Reloading a state that wraps the client's contiguous OHWI tensor (channels-last OIHW)
    gives the kernel the same weights, and the same float64 forward, as the same values in
    contiguous OIHW storage; the state still is the client's memory."""
    gen = torch.Generator().manual_seed(1)
    shape = desc.weights_shape
    w = torch.randn(shape, generator=gen, dtype=F64)
    b = torch.randn(shape[0], generator=gen, dtype=F64)
    zeros = torch.zeros(shape, dtype=F64)
    x = m.Image.from_tensor(
        torch.randn(2, desc.input_feature_channels, *hw, generator=gen, dtype=F64)
    )
    outs = []
    for wrapped in (True, False):
        k = kind(
            CPU,
            m.TensorConvolutionDataSource(desc, zeros.clone(), torch.zeros(shape[0], dtype=F64)),
        )
        if wrapped:
            st = m.ConvolutionWeightsAndBiasesState(w, b)
            assert _same_storage(st.weights, w)
        else:
            st = m.ConvolutionWeightsAndBiasesState.from_descriptor(CPU, desc, dtype=F64)
            st.weights.copy_(w)
            st.biases.copy_(b)
            assert st._oihw.is_contiguous()
        cb = CPU.new_command_queue().command_buffer()
        k.reload_weights_and_biases(cb, st)
        y = k.encode(cb, x)
        run(cb)
        assert torch.equal(k.weights, w) and torch.equal(k.biases, b)
        outs.append(y.tensor)
    assert torch.equal(outs[0], outs[1])


# -- optimizers write a wrapped state in place ------------------------------------------------


def _gradient_state(
    seed: int, device: m.Device = CPU, dtype: torch.dtype = F64
) -> tuple[Any, Any, Any]:
    """A 3x3 convolution's gradient, run: (queue, gradient state, weights used)."""
    desc = m.ConvolutionDescriptor(3, 3, 3, 4)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(desc.weights_shape, generator=gen, dtype=dtype)
    ds = m.TensorConvolutionDataSource(desc, w, torch.randn(4, generator=gen, dtype=dtype))
    conv, grad = m.Convolution(device, ds), m.ConvolutionGradient(device, ds)
    q = device.new_command_queue()
    dev = device.torch_device
    x = m.ImageBatch.from_tensor(torch.randn(2, 3, 5, 5, generator=gen, dtype=dtype).to(dev))
    g = m.ImageBatch.from_tensor(torch.randn(2, 4, 5, 5, generator=gen, dtype=dtype).to(dev))
    st = conv.result_state_batch(x)
    cb = q.command_buffer()
    conv.encode_batch(cb, x, destination_states=st)
    grad.encode_batch(cb, g, x, st)
    run(cb)
    # the weights used, as a contiguous OHWI tensor (the masters are OIHW)
    return q, st[0], (conv.weights.contiguous(), conv.biases.clone())


_OPTIMIZERS: dict[str, tuple[Callable[[m.Device], Any], tuple[str, ...]]] = {
    "sgd": (lambda d: m.SGD(d, descriptor=m.OptimizerDescriptor(learning_rate=0.1)), ()),
    "sgd_momentum": (
        lambda d: m.SGD(d, 0.9, True, m.OptimizerDescriptor(learning_rate=0.1)),
        ("input_momentum_vectors",),
    ),
    "rmsprop": (
        lambda d: m.RMSProp(d, 0.9, 1e-3, m.OptimizerDescriptor(learning_rate=0.01)),
        ("input_sum_of_squares_vectors",),
    ),
    "adam": (
        lambda d: m.Adam(d, descriptor=m.OptimizerDescriptor(learning_rate=0.01)),
        ("input_momentum_vectors", "input_velocity_vectors"),
    ),
}
# float64 on the CPU; float32 on CUDA, where the contiguous state takes the one-launch Triton
# update and the wrapped channels-last one the portable path
_PRECISIONS = [("cpu", F64)] + ([("cuda", torch.float32)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize(("device", "dtype"), _PRECISIONS, ids=lambda v: str(v))
@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_an_optimizer_encoded_into_a_wrapped_state_updates_the_clients_tensors(
    name: str, device: str, dtype: torch.dtype
) -> None:
    """Three updates encoded into a state built from the client's (contiguous OHWI) tensors,
    read from and written to that state: the client's tensors change, in place, and equal the
    same updates on a contiguous OIHW copy (every state vector OHWI)."""
    make, keys = _OPTIMIZERS[name]
    dev = m.Device(device)
    tol = 1e-14 if dtype == F64 else 1e-6
    q, gs, (w0, b0) = _gradient_state(3, dev, dtype)
    w, b = w0.clone(), b0.clone()  # the client's own tensors
    wrapped = m.ConvolutionWeightsAndBiasesState(w, b)
    plain = m.ConvolutionWeightsAndBiasesState.from_descriptor(
        dev, m.ConvolutionDescriptor(3, 3, 3, 4), dtype=dtype
    )
    assert wrapped._oihw.is_contiguous(memory_format=torch.channels_last)
    assert not wrapped._oihw.is_contiguous() and plain._oihw.is_contiguous()
    plain.weights.copy_(w0)
    plain.biases.copy_(b0)
    runs = []
    for st in (wrapped, plain):
        opt = make(dev)
        vectors = {k: [torch.zeros_like(w0), torch.zeros_like(b0)] for k in keys}
        for _ in range(3):
            cb = q.command_buffer()
            opt.encode(
                cb, convolution_gradient_state=gs, convolution_source_state=st,
                result_state=st, **vectors,
            )  # fmt: skip
            run(cb)
        runs.append((st.weights.clone(), st.biases.clone(), vectors))
    assert _same_storage(wrapped.weights, w) and _same_storage(wrapped.biases, b)
    assert not torch.equal(w, w0) and not torch.equal(b, b0)
    assert torch.equal(runs[0][0], w) and torch.equal(runs[0][1], b)
    assert_close(w, runs[1][0], f"{name}: wrapped weights vs contiguous", tol=tol)
    assert_close(b, runs[1][1], f"{name}: wrapped biases vs contiguous", tol=tol)
    for k in keys:
        for a, e in zip(runs[0][2][k], runs[1][2][k], strict=True):
            assert_close(a, e, f"{name}: {k}", tol=tol)


def test_an_update_out_of_place_writes_the_wrapped_result_and_keeps_the_source() -> None:
    """MPS's out-of-place form: read the weights the kernel used (an exported state), write
    the data source's own wrapped tensors."""
    q, gs, (w0, b0) = _gradient_state(seed=4)
    source = m.ConvolutionWeightsAndBiasesState(w0.clone(), b0.clone())
    w, b = torch.zeros_like(w0), torch.zeros_like(b0)
    opt = m.SGD(CPU, descriptor=m.OptimizerDescriptor(learning_rate=0.5))
    cb = q.command_buffer()
    opt.encode(
        cb, convolution_gradient_state=gs, convolution_source_state=source,
        result_state=m.ConvolutionWeightsAndBiasesState(w, b),
    )  # fmt: skip
    run(cb)
    assert torch.equal(source.weights, w0)
    assert_close(w, w0 - 0.5 * gs.gradient_for_weights, "SGD into the client's weights", tol=1e-14)
    assert_close(b, b0 - 0.5 * gs.gradient_for_biases, "SGD into the client's biases", tol=1e-14)


# -- TensorConvolutionDataSource wraps ---------------------------------------------------------


def test_tensor_data_source_wraps_and_trains_the_clients_tensors() -> None:
    """The data source's values are the client's OHWI float32 tensor and biases: what its
    optimizer writes (CPU and GPU update paths) and what ``weights()`` returns."""
    desc = m.ConvolutionDescriptor(3, 3, 2, 3)
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(desc.weights_shape, generator=gen)
    b = torch.randn(3, generator=gen)
    w0, b0 = w.clone(), b.clone()
    ds = m.TensorConvolutionDataSource(
        desc, w, b, m.SGD(CPU, descriptor=m.OptimizerDescriptor(learning_rate=0.1))
    )
    assert _same_storage(ds.weights(), w) and _same_storage(ds.bias_terms(), b)
    assert _same_storage(ds.state.weights, w)
    conv, grad = m.Convolution(CPU, ds), m.ConvolutionGradient(CPU, ds)
    x = m.ImageBatch.from_tensor(torch.randn(2, 2, 5, 5, generator=gen))
    g = m.ImageBatch.from_tensor(torch.randn(2, 3, 5, 5, generator=gen))
    q = CPU.new_command_queue()
    st = conv.result_state_batch(x)
    cb = q.command_buffer()
    conv.encode_batch(cb, x, destination_states=st)
    grad.encode_batch(cb, g, x, st)
    run(cb)
    assert ds.update_on_cpu(st[0], None)
    assert_close(w, w0 - 0.1 * st[0].gradient_for_weights, "CPU update path", tol=1e-6)
    cb = q.command_buffer()
    new = ds.update(cb, st[0], None)
    run(cb)
    assert new is ds.state and _same_storage(new.weights, w)
    assert_close(w, w0 - 0.2 * st[0].gradient_for_weights, "GPU update path", tol=1e-6)
    assert_close(b, b0 - 0.2 * st[0].gradient_for_biases, "biases", tol=1e-6)
    ds.set_weights_and_biases(torch.ones(desc.weights_shape), torch.zeros(3))
    assert torch.equal(w, torch.ones(desc.weights_shape)) and torch.equal(b, torch.zeros(3))


def test_tensor_data_source_wraps_a_writable_numpy_array() -> None:
    desc = m.ConvolutionDescriptor(1, 1, 2, 2)
    a = np.arange(4, dtype=np.float32).reshape(2, 1, 1, 2)
    ds = m.TensorConvolutionDataSource(desc, a)
    ds.set_weights_and_biases(np.full((2, 1, 1, 2), 3.0, dtype=np.float32))
    assert (a == 3.0).all()


def test_tensor_data_source_copies_what_it_cannot_wrap() -> None:
    """Copies: float16/bfloat16 values (widened to float32 masters), read-only arrays, weights
    with gaps; each the data source's own memory afterwards."""
    desc = m.ConvolutionDescriptor(3, 3, 2, 3)
    half = torch.randn(desc.weights_shape).half()
    ds = m.TensorConvolutionDataSource(desc, half)
    assert ds.weights().dtype == torch.float32 and torch.equal(ds.weights(), half.float())
    frozen = np.ones(desc.weights_shape, dtype=np.float32)
    frozen.flags.writeable = False
    ds = m.TensorConvolutionDataSource(desc, frozen)
    ds.set_weights_and_biases(np.zeros(desc.weights_shape, dtype=np.float32))
    assert (frozen == 1.0).all() and float(ds.weights().abs().sum()) == 0.0
    base = torch.randn(3, 3, 3, 4)
    ds = m.TensorConvolutionDataSource(desc, base[..., ::2])
    assert ds.state._oihw.is_contiguous() and torch.equal(ds.weights(), base[..., ::2])
    # float32 weights alongside: wrapped, whatever the biases were
    w = torch.randn(desc.weights_shape)
    ds = m.TensorConvolutionDataSource(desc, w, np.zeros(3, dtype=np.float64))
    assert _same_storage(ds.weights(), w) and ds.bias_terms().dtype == torch.float32


# -- flat weights buffers ----------------------------------------------------------------------


class _FlatSource(m.ConvolutionDataSource):
    """A data source whose ``weights()`` is a flat buffer, as MPS's weights pointer is."""

    def __init__(self, desc: m.ConvolutionDescriptor, weights: Any, biases: Any) -> None:
        self._desc, self.w, self.b = desc, weights, biases

    def descriptor(self) -> m.ConvolutionDescriptor:
        return self._desc

    def weights(self) -> Any:
        return self.w

    def bias_terms(self) -> Any:
        return self.b


@pytest.mark.parametrize("as_numpy", [False, True], ids=["tensor", "numpy"])
def test_flat_weights_are_shaped_by_the_descriptor(as_numpy: bool) -> None:
    """O·kH·kW·I/groups values read as OHWI: the same kernel as the 4-D weights (also on a
    reload from the data source)."""
    desc = m.ConvolutionDescriptor(3, 2, 4, 6, groups=2)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(desc.weights_shape, generator=gen, dtype=F64)
    b = torch.randn(6, generator=gen, dtype=F64)
    flat: Any = w.reshape(-1).clone()
    flat_b: Any = b.clone()
    if as_numpy:
        flat, flat_b = flat.numpy(), flat_b.numpy()
    src = _FlatSource(desc, flat, flat_b)
    conv = m.Convolution(CPU, src)
    ref = m.Convolution(CPU, m.TensorConvolutionDataSource(desc, w, b))
    assert torch.equal(conv.weights, w) and torch.equal(conv.biases, b)
    x = m.Image.from_tensor(torch.randn(1, 4, 6, 5, generator=gen, dtype=F64))
    cb = CPU.new_command_queue().command_buffer()
    y, y_ref = conv.encode(cb, x), ref.encode(cb, x)
    run(cb)
    assert torch.equal(y.tensor, y_ref.tensor)
    src.w = (2 * w).reshape(-1).numpy() if as_numpy else (2 * w).reshape(-1)
    conv.reload_weights_and_biases_from_data_source()
    assert torch.equal(conv.weights, 2 * w)
    m.ConvolutionGradient(CPU, src)  # the gradient reads the data source too


def test_tensor_data_source_wraps_a_flat_tensor_as_ohwi() -> None:
    desc = m.ConvolutionDescriptor(2, 2, 3, 2)
    flat = torch.randn(math.prod(desc.weights_shape))
    ds = m.TensorConvolutionDataSource(desc, flat)
    assert ds.weights().shape == desc.weights_shape and ds.weights().data_ptr() == flat.data_ptr()
    assert torch.equal(ds.weights().reshape(-1), flat)


def test_flat_weights_of_the_wrong_length_are_refused_naming_both_lengths() -> None:
    desc = m.ConvolutionDescriptor(3, 3, 2, 4)  # 4·3·3·2 = 72 values
    src = _FlatSource(desc, torch.zeros(70), None)
    msg = (
        r"weights given flat must hold O·kH·kW·I/groups = 72 values \(the OHWI shape "
        r"\(4, 3, 3, 2\)\), got 70"
    )
    with pytest.raises(ValueError, match=r"\[Convolution\] " + msg):
        m.Convolution(CPU, src)
    with pytest.raises(ValueError, match=r"\[ConvolutionGradient\] " + msg):
        m.ConvolutionGradient(CPU, src)
    with pytest.raises(ValueError, match=r"\[TensorConvolutionDataSource\] " + msg):
        m.TensorConvolutionDataSource(desc, np.zeros(70, dtype=np.float32))
    src.w = torch.zeros(72)
    conv = m.Convolution(CPU, src)
    src.w = torch.zeros(73)
    with pytest.raises(ValueError, match=r"\[Convolution\] weights given flat .* got 73"):
        conv.reload_weights_and_biases_from_data_source()
    src.w, src.b = torch.zeros(72), torch.zeros(3)
    with pytest.raises(
        ValueError, match=r"\[Convolution\] biases must have shape \(4,\), got \(3,\)"
    ):
        conv.reload_weights_and_biases_from_data_source()


def test_an_array_with_negative_strides_is_copied() -> None:
    """No tensor views ``a[::-1]``: the data source copies it (values kept), not a TypeError."""
    desc = m.ConvolutionDescriptor(3, 3, 2, 3)
    a = np.random.default_rng(5).random(desc.weights_shape).astype(np.float32)[::-1]
    ds = m.TensorConvolutionDataSource(desc, a)
    assert np.array_equal(ds.weights().numpy(), a)
