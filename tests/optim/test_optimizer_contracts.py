"""The MPS contracts clients of the optimizers rely on: Adam's ``time_step`` counted at encode
(its device copy advanced by the work), the ``initWithDevice:learningRate:`` forms, flat
state vectors (an ``MPSVector`` is flat), hyperparameter ranges, and dtypes checked at
encode."""

from __future__ import annotations

import math

import pytest
import torch

import mpsnn as m
from tests.helpers import assert_close

CPU = m.Device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _adam_step(w, g, mo, v, t, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    """One MPS Adam update at time step ``t`` (float64): (w, m, v) after it."""
    lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
    mo = b1 * mo + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return w - lr_t * mo / (v.sqrt() + eps), mo, v


def _encode_vector(opt, cb, w, g, r, *states):
    names = {
        m.SGD: ("input_momentum_vector",),
        m.RMSProp: ("input_sum_of_squares_vector",),
        m.Adam: ("input_momentum_vector", "input_velocity_vector"),
    }[type(opt)]
    opt.encode(
        cb, input_gradient_vector=g, input_values_vector=w, result_values_vector=r,
        **dict(zip(names, states, strict=False)),
    )  # fmt: skip


# -- A. time_step ------------------------------------------------------------------------------


def test_adam_time_step_advances_at_encode_and_its_device_copy_with_the_work() -> None:
    adam = m.Adam(CPU)
    w, g = (
        torch.randn(5, generator=_gen(0), dtype=torch.float64),
        torch.randn(5, generator=_gen(1), dtype=torch.float64),
    )
    mo, v = torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    r = torch.empty_like(w)
    cb = CPU.new_command_queue().command_buffer()
    _encode_vector(adam, cb, w, g, r, mo, v)
    assert adam.time_step == 1  # what the client sees: counted at encode (Apple's sample)
    assert int(adam._step[0]) == 0  # the device copy: the work has not run
    cb.commit()
    assert adam.time_step == 1 and int(adam._step[0]) == 1
    ref, _, _ = _adam_step(w, g, torch.zeros_like(w), torch.zeros_like(w), 1)
    assert_close(r, ref, "Adam at t = 1", 1e-12)


def test_an_abandoned_buffers_encode_still_counts() -> None:
    adam = m.Adam(CPU)
    q = CPU.new_command_queue()
    gen = _gen(2)
    w, g = (
        torch.randn(4, generator=gen, dtype=torch.float64),
        torch.randn(4, generator=gen, dtype=torch.float64),
    )
    mo, v = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    abandoned = q.command_buffer()
    _encode_vector(adam, abandoned, w, g, torch.empty_like(w), mo.clone(), v.clone())
    cb = q.command_buffer()
    r = torch.empty_like(w)
    _encode_vector(adam, cb, w, g, r, mo, v)
    cb.commit()  # `abandoned` is never committed
    assert adam.time_step == 2 and int(adam._step[0]) == 2
    ref, _, _ = _adam_step(w, g, torch.zeros_like(w), torch.zeros_like(w), 2)
    assert_close(r, ref, "the committed encode runs at t = 2 (MPS counts at encode)", 1e-12)


def test_setting_time_step_sets_the_next_encodes_base_whatever_the_commit_order() -> None:
    adam = m.Adam(CPU, time_step=3)
    q = CPU.new_command_queue()
    gen = _gen(3)
    w, g = (
        torch.randn(6, generator=gen, dtype=torch.float64),
        torch.randn(6, generator=gen, dtype=torch.float64),
    )
    states = [[torch.zeros(6, dtype=torch.float64) for _ in range(2)] for _ in range(2)]
    results = [torch.empty_like(w), torch.empty_like(w)]
    first, second = q.command_buffer(), q.command_buffer()
    _encode_vector(adam, first, w, g, results[0], *states[0])  # t = 4
    assert adam.time_step == 4
    adam.time_step = 10
    _encode_vector(adam, second, w, g, results[1], *states[1])  # t = 11
    assert adam.time_step == 11
    second.commit()
    first.commit()  # committed last: it still runs at its own encode's t
    zero = torch.zeros_like(w)
    for r, t in zip(results, (4, 11), strict=True):
        assert_close(r, _adam_step(w, g, zero, zero, t)[0], f"Adam at t = {t}", 1e-12)
    assert adam.time_step == 11
    with pytest.raises(ValueError, match=r"\[Adam\] time_step must be an int >= 0, got -2"):
        adam.time_step = -2


def test_adam_saves_the_count_the_client_sees(tmp_path) -> None:
    adam = m.Adam(CPU, time_step=2)
    w = torch.randn(3, generator=_gen(4), dtype=torch.float64)
    cb = CPU.new_command_queue().command_buffer()
    _encode_vector(
        adam, cb, w, w.clone(), torch.empty_like(w), torch.zeros_like(w), torch.zeros_like(w)
    )
    path = tmp_path / "adam.mpsnn"
    m.save(adam, path)  # the encode is not committed: the host count is 3, the device's 2
    loaded = m.load(path, CPU)
    assert loaded.time_step == 3 and int(loaded._step[0]) == 3


# -- C. initWithDevice:learningRate: ------------------------------------------------------------


@pytest.mark.parametrize("kind", [m.SGD, m.RMSProp, m.Adam])
def test_learning_rate_form(kind) -> None:
    opt = kind(CPU, learning_rate=0.25)
    assert opt.learning_rate == 0.25
    default = kind(CPU)
    assert opt.gradient_rescale == default.gradient_rescale == 1.0  # the rest: defaults
    assert float(opt._hyper[0]) == 0.25
    name = kind.__name__
    with pytest.raises(ValueError, match=rf"\[{name}\] learning_rate and descriptor .*got both"):
        kind(CPU, learning_rate=0.1, descriptor=m.OptimizerDescriptor(learning_rate=0.1))
    with pytest.raises(ValueError, match=rf"\[{name}\] learning_rate must be finite, got inf"):
        kind(CPU, learning_rate=math.inf)
    assert kind(CPU, learning_rate=-0.5).learning_rate == -0.5  # negative rates stay legal


# -- C. flat state vectors ---------------------------------------------------------------------


def test_flat_state_vectors_in_the_vector_form_are_shaped_by_the_values_in_place() -> None:
    gen = _gen(5)
    w, g = (
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
        torch.randn(3, 4, generator=gen, dtype=torch.float64),
    )
    adam = m.Adam(CPU)
    mo, v = torch.zeros(12, dtype=torch.float64), torch.zeros(12, dtype=torch.float64)
    r = torch.empty_like(w)
    cb = CPU.new_command_queue().command_buffer()
    _encode_vector(adam, cb, w, g, r, mo, v)
    cb.commit()
    ref, ref_m, ref_v = _adam_step(w, g, torch.zeros_like(w), torch.zeros_like(w), 1)
    assert_close(r, ref, "Adam with flat vectors", 1e-12)
    assert_close(mo, ref_m.reshape(-1), "the client's flat momentum, updated", 1e-12)
    assert_close(v, ref_v.reshape(-1), "the client's flat velocity, updated", 1e-12)
    cb = CPU.new_command_queue().command_buffer()
    with pytest.raises(
        ValueError, match=r"\[Adam\] input_velocity_vector must hold 12 elements .*got 11"
    ):
        _encode_vector(adam, cb, w, g, r, mo, torch.zeros(11, dtype=torch.float64))
    assert len(cb) == 0 and adam.time_step == 1


def test_vector_form_states_take_the_values_shape_whatever_its_rank() -> None:
    """A 4-D tensor in the vector form is no convolution's weights: its state vectors have
    its own shape (or are flat), not an OHWI permutation of it."""
    gen = _gen(8)
    w = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    zero = torch.zeros_like(w)
    ref, ref_m, _ = _adam_step(w, g, zero, zero, 1)
    for mo, v in (
        (zero.clone(), zero.clone()),
        (zero.reshape(-1).clone(), zero.reshape(-1).clone()),
    ):
        adam, r = m.Adam(CPU), torch.empty_like(w)
        cb = CPU.new_command_queue().command_buffer()
        _encode_vector(adam, cb, w, g, r, mo, v)
        cb.commit()
        assert_close(r, ref, f"4-D values, states {tuple(mo.shape)}", 1e-12)
        assert_close(mo.reshape(w.shape), ref_m, "momentum in the values' order", 1e-12)


def _conv_gradient(seed: int):
    desc = m.ConvolutionDescriptor(3, 3, 2, 4)
    gen = _gen(seed)
    ds = m.TensorConvolutionDataSource(
        desc, torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64),
        torch.randn(4, generator=gen, dtype=torch.float64),
    )  # fmt: skip
    conv, grad = m.Convolution(CPU, ds), m.ConvolutionGradient(CPU, ds)
    x = m.ImageBatch.from_tensor(torch.randn(2, 2, 5, 5, generator=gen, dtype=torch.float64))
    gy = m.ImageBatch.from_tensor(torch.randn(2, 4, 5, 5, generator=gen, dtype=torch.float64))
    st = conv.result_state_batch(x)
    cb = CPU.new_command_queue().command_buffer()
    conv.encode_batch(cb, x, destination_states=st)
    grad.encode_batch(cb, gy, x, st)
    return cb, st[0], conv.export_weights_and_biases(cb)


def test_flat_momentum_vectors_of_a_convolution_equal_the_shaped_ones() -> None:
    outcomes = []
    for flat in (False, True):
        cb, gs, source = _conv_gradient(6)
        sgd = m.SGD(CPU, momentum_scale=0.5, learning_rate=0.1)
        shape = source.weights.shape  # OHWI
        gen = _gen(7)
        mom_w = torch.randn(shape, generator=gen, dtype=torch.float64)
        mom_b = torch.randn(4, generator=gen, dtype=torch.float64)
        if flat:
            mom_w = mom_w.reshape(-1).clone()  # the client's MPSVector: OHWI order, flat
        result = m.ConvolutionWeightsAndBiasesState(
            torch.zeros(shape, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
        )
        sgd.encode(
            cb, convolution_gradient_state=gs, convolution_source_state=source,
            input_momentum_vectors=[mom_w, mom_b], result_state=result,
        )  # fmt: skip
        cb.commit()
        outcomes.append((result.weights.clone(), result.biases.clone(), mom_w.reshape(shape)))
    for a, b in zip(*outcomes, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(outcomes[0][2], torch.zeros_like(outcomes[0][2]))
    cb, gs, source = _conv_gradient(6)
    with pytest.raises(
        ValueError, match=r"\[SGD\] input_momentum_vectors\[0\] must hold 72 elements .*got 71"
    ):
        m.SGD(CPU, momentum_scale=0.5).encode(
            cb, convolution_gradient_state=gs, convolution_source_state=source,
            input_momentum_vectors=[torch.zeros(71, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)],
            result_state=source,
        )  # fmt: skip


# -- D. hyperparameter ranges ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: m.RMSProp(CPU, decay=1.5), r"\[RMSProp\] decay must be in \[0, 1\], got 1.5"),
        (lambda: m.RMSProp(CPU, decay=-0.1), r"\[RMSProp\] decay must be in \[0, 1\], got -0.1"),
        (lambda: m.RMSProp(CPU, epsilon=-1.0), r"\[RMSProp\] epsilon must be >= 0, got -1.0"),
        (lambda: m.Adam(CPU, beta1=1.5), r"\[Adam\] beta1 must be in \[0, 1\), got 1.5"),
        (lambda: m.Adam(CPU, beta1=1.0), r"\[Adam\] beta1 must be in \[0, 1\), got 1.0"),
        (lambda: m.Adam(CPU, beta2=2), r"\[Adam\] beta2 must be in \[0, 1\), got 2"),
        (lambda: m.Adam(CPU, beta2=-0.5), r"\[Adam\] beta2 must be in \[0, 1\), got -0.5"),
        (lambda: m.Adam(CPU, epsilon=-1), r"\[Adam\] epsilon must be >= 0, got -1"),
        (lambda: m.SGD(CPU, momentum_scale=-1), r"\[SGD\] momentum_scale must be >= 0, got -1"),
    ],
)
def test_hyperparameter_ranges(make, message) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_range_edges_are_legal() -> None:
    assert m.RMSProp(CPU, decay=1.0, epsilon=0.0).decay == 1.0
    assert m.RMSProp(CPU, decay=0.0).decay == 0.0
    assert m.Adam(CPU, beta1=0.0, beta2=0.0, epsilon=0.0).beta2 == 0.0
    assert m.SGD(CPU, momentum_scale=0.0).momentum_scale == 0.0
    with pytest.raises(ValueError, match=r"\[OptimizerDescriptor\] learning_rate must be finite"):
        m.OptimizerDescriptor(learning_rate=math.nan)
    adam = m.Adam(CPU)
    with pytest.raises(ValueError, match=r"\[Adam\] learning_rate must be finite, got inf"):
        adam.learning_rate = math.inf
    adam.learning_rate = -1.0
    assert adam.learning_rate == -1.0


# -- E. dtypes at encode -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", [m.SGD, m.RMSProp, m.Adam])
def test_non_floating_or_mismatched_vectors_fail_at_encode(kind) -> None:
    name = kind.__name__
    opt = kind(CPU, momentum_scale=0.9) if kind is m.SGD else kind(CPU)
    n_states = 2 if kind is m.Adam else 1
    f32 = torch.zeros(4)
    cases = [
        # (values, gradient, result, states, what the message names)
        (f32.long(), f32.long(), f32.long(), [f32.long()] * n_states, "values"),
        (f32, f32, f32, [f32.long()] * n_states, "state vectors"),
        (f32, f32, f32, [f32.double()] * n_states, "state vectors"),
        (f32, f32.long(), f32, [f32] * n_states, "input_gradient_vector"),
        (f32, f32, f32.double(), [f32] * n_states, "result_values_vector"),
    ]
    for w, g, r, states, what in cases:
        cb = CPU.new_command_queue().command_buffer()
        with pytest.raises(TypeError, match=rf"\[{name}\] .*{what}.*got torch\.(int64|float64)"):
            _encode_vector(opt, cb, w, g, r, *[s.clone() for s in states])
        assert len(cb) == 0
