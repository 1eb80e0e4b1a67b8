"""The float32 precision contract: mpsnn's float32 convolutions and matrix products are float32
arithmetic on every device (no TF32 on CUDA) unless `mpsnn.set_float32_matmul_precision`
allows TF32, and PyTorch's own flags stay as the user set them.

Without a GPU, the decision (`tf32_allowed`), the flags in force inside a guarded call (a
stand-in operand that reads as a float32 CUDA tensor), their restoration, and the wiring of
every cuDNN/cuBLAS call of the convolution ops (each one recorded while real kernels run) are
checked on the CPU; the CUDA tests compare with float64 under PyTorch's TF32 defaults."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
import mpsnn.ops.convolution as conv_ops
from mpsnn.core import precision
from tests.helpers import TOL, assert_close, float32_reference, run, torch_tf32

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="TF32 exists on CUDA only")


@pytest.fixture(autouse=True)
def _default_precision():
    yield
    m.set_float32_matmul_precision("highest")


def _torch_flags() -> tuple[Any, ...]:
    """Everything of PyTorch's float32 precision state that a user can read."""
    state: tuple[Any, ...] = (
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
        torch.get_float32_matmul_precision(),
    )
    if precision._PER_OPERATOR:
        state += tuple(
            precision._get_precision(b, op)
            for b, op in [("cuda", "conv"), ("cuda", "matmul"), ("cuda", "rnn"), ("cuda", "all")]
        )
    return state


def _in_force() -> tuple[bool, bool]:
    """Whether a cuDNN convolution / cuBLAS product issued now may use TF32."""
    if precision._PER_OPERATOR:
        return (
            torch.backends.cudnn.conv.fp32_precision == "tf32",
            torch.backends.cuda.matmul.fp32_precision == "tf32",
        )
    return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32


def _cuda_float32() -> Any:
    """What `float32_call` reads of an operand, as a float32 CUDA tensor has it."""
    return SimpleNamespace(dtype=torch.float32, is_cuda=True)


# -- the switch -------------------------------------------------------------------------------


def test_the_switch_defaults_to_highest_and_round_trips() -> None:
    assert m.get_float32_matmul_precision() == "highest"
    for p in ("high", "medium", "highest"):
        m.set_float32_matmul_precision(p)
        assert m.get_float32_matmul_precision() == p


def test_the_switch_validates_its_argument() -> None:
    with pytest.raises(
        ValueError,
        match=r"\[set_float32_matmul_precision\] precision must be one of 'highest', 'high', "
        r"'medium', got 'HIGH'",
    ):
        m.set_float32_matmul_precision("HIGH")
    with pytest.raises(
        TypeError, match=r"\[set_float32_matmul_precision\] precision must be a str, got bool"
    ):
        m.set_float32_matmul_precision(True)  # type: ignore[arg-type]
    assert m.get_float32_matmul_precision() == "highest"  # unchanged by the failures


def test_the_switch_does_not_touch_pytorchs_settings() -> None:
    before = _torch_flags()
    m.set_float32_matmul_precision("high")
    assert _torch_flags() == before
    m.set_float32_matmul_precision("highest")
    assert _torch_flags() == before


def test_tf32_is_allowed_only_for_float32_on_cuda_and_only_when_asked() -> None:
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    for p in ("highest", "high", "medium"):
        m.set_float32_matmul_precision(p)
        for dtype in dtypes:
            for device in ("cpu", "cuda"):
                want = p != "highest" and dtype is torch.float32 and device == "cuda"
                assert precision.tf32_allowed(dtype, device) is want, (p, dtype, device)


# -- the guarded call -------------------------------------------------------------------------


CALLS = {  # guard -> which of (cuDNN convolutions, cuBLAS products) it sets
    "float32_call": (False, True),
    "float32_conv_call": (True, False),
}


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("user", [True, False], ids=["user-tf32-on", "user-tf32-off"])
@pytest.mark.parametrize("mpsnn_precision", ["highest", "high", "medium"])
def test_a_float32_cuda_call_runs_under_the_switch_and_restores_the_flags(
    user: bool, mpsnn_precision: str, call: str
) -> None:
    m.set_float32_matmul_precision(mpsnn_precision)
    guard = getattr(precision, call)
    want = mpsnn_precision != "highest"
    expected = tuple(want if sets else user for sets in CALLS[call])
    seen = []
    with torch_tf32(user):
        before = _torch_flags()
        assert guard(lambda a: (seen.append(_in_force()), a)[1], _cuda_float32(), 7) == 7
        assert _torch_flags() == before
        assert seen == [expected]

        # an error inside the call: the flags are restored all the same
        def fails() -> None:
            seen.append(_in_force())
            raise RuntimeError("inside")

        with pytest.raises(RuntimeError, match="inside"):
            guard(fails, _cuda_float32())
        assert seen[-1] == expected
        assert _torch_flags() == before


@pytest.mark.parametrize("user", [True, False], ids=["user-tf32-on", "user-tf32-off"])
def test_a_convolution_without_cudnn_is_guarded_as_a_product_too(user: bool) -> None:
    """With cuDNN turned off, PyTorch computes a convolution with cuBLAS products."""
    enabled = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False
    try:
        with torch_tf32(user):
            before = _torch_flags()
            assert precision.float32_conv_call(_in_force, _cuda_float32()) == (False, False)
            assert _torch_flags() == before
    finally:
        torch.backends.cudnn.enabled = enabled


@pytest.mark.parametrize(
    "operand",
    [
        torch.zeros(1),  # the CPU: TF32 does not exist there
        SimpleNamespace(dtype=torch.float64, is_cuda=True),
        SimpleNamespace(dtype=torch.float16, is_cuda=True),
        SimpleNamespace(dtype=torch.bfloat16, is_cuda=True),
    ],
    ids=["cpu-float32", "cuda-float64", "cuda-float16", "cuda-bfloat16"],
)
def test_other_calls_run_under_pytorchs_flags_untouched(operand: Any) -> None:
    with torch_tf32(True):
        before = _torch_flags()
        for guard in (precision.float32_call, precision.float32_conv_call):
            assert guard(_torch_flags, operand) == before == _torch_flags()


@pytest.mark.parametrize("user", [True, False], ids=["user-tf32-on", "user-tf32-off"])
def test_mpsnn_check_leaves_pytorchs_flags_and_the_switch_as_they_were(user: bool) -> None:
    from click.testing import CliRunner

    from mpsnn.cli import main

    m.set_float32_matmul_precision("high")
    with torch_tf32(user):
        before = _torch_flags()
        result = CliRunner().invoke(main, ["check", "convolution", "--json"])
        assert result.exit_code == 0, result.output
        assert _torch_flags() == before
    assert m.get_float32_matmul_precision() == "high"


# -- every cuDNN / cuBLAS call of the convolution ops goes through the guard -------------------


def _record_calls(monkeypatch: pytest.MonkeyPatch, fail: str | None = None) -> dict[str, list]:
    """The convolution ops' float32 CPU calls guarded as CUDA ones would be, and each library
    function they call recording the TF32 flags in force (``fail``: that one raises)."""
    seen: dict[str, list] = {}

    def guard(op: str) -> Any:
        def guarded(fn: Any, x: torch.Tensor, *args: Any) -> Any:
            if x.dtype is torch.float32:  # what a CUDA operand takes
                return precision._under_mode(fn, args, op)
            return fn(*args)

        return guarded

    def recorder(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.setdefault(name, []).append(_in_force())
            if name == fail:
                raise RuntimeError(f"{name} failed")
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(conv_ops, "float32_call", guard("matmul"))
    monkeypatch.setattr(conv_ops, "float32_conv_call", guard("conv"))
    for name in ("conv2d", "conv_transpose2d", "linear"):
        monkeypatch.setattr(F, name, recorder(name, getattr(F, name)))
    monkeypatch.setattr(torch, "mm", recorder("mm", torch.mm))
    monkeypatch.setattr(
        conv_ops, "_conv_backward", recorder("convolution_backward", conv_ops._conv_backward)
    )
    return seen


def _train_each_kind(device: m.Device, gen: torch.Generator) -> None:
    """Forward and gradient of a convolution, a fully connected layer and a convolution
    transpose (zero and clamp edges: cuDNN's transpose, and the zero-inserted convolution)."""
    desc = m.ConvolutionDescriptor(3, 3, 2, 3)
    ds = m.TensorConvolutionDataSource(
        desc, torch.randn(desc.weights_shape, generator=gen), torch.randn(3, generator=gen)
    )
    fc_desc = m.ConvolutionDescriptor(5, 5, 3, 4)
    fc_ds = m.TensorConvolutionDataSource(
        fc_desc, torch.randn(fc_desc.weights_shape, generator=gen), torch.randn(4, generator=gen)
    )
    tr_desc = m.ConvolutionDescriptor(3, 3, 3, 2, 2, 2)
    tr_ds = m.TensorConvolutionDataSource(
        tr_desc, torch.randn(tr_desc.weights_shape, generator=gen), torch.randn(2, generator=gen)
    )
    x = m.Image.from_tensor(torch.randn(2, 2, 5, 5, generator=gen))
    cb = device.new_command_queue().command_buffer()
    conv = m.Convolution(device, ds)
    state = conv.result_state(x)
    y = conv.encode(cb, x, destination_state=state)
    m.ConvolutionGradient(device, ds).encode(
        cb, m.Image.from_tensor(torch.randn(y.shape)), x, state
    )
    fc = m.FullyConnected(device, fc_ds)
    fc_state = fc.result_state(y)
    z = fc.encode(cb, y, destination_state=fc_state)
    m.FullyConnectedGradient(device, fc_ds).encode(
        cb, m.Image.from_tensor(torch.randn(z.shape)), y, fc_state
    )
    for edge in (m.EdgeMode.ZERO, m.EdgeMode.CLAMP):
        tr = m.ConvolutionTranspose(device, tr_ds)
        tr.edge_mode = edge
        tr_state = tr.result_state(y)
        t = tr.encode(cb, y, destination_state=tr_state)
        m.ConvolutionTransposeGradient(device, tr_ds).encode(
            cb, m.Image.from_tensor(torch.randn(t.shape)), y, tr_state
        )
    run(cb)


@pytest.mark.parametrize("mpsnn_precision", ["highest", "high"])
def test_every_library_call_of_the_convolution_ops_is_guarded(
    monkeypatch: pytest.MonkeyPatch, mpsnn_precision: str
) -> None:
    m.set_float32_matmul_precision(mpsnn_precision)
    seen = _record_calls(monkeypatch)
    with torch_tf32(mpsnn_precision == "highest"):  # the opposite of what mpsnn asks for
        before = _torch_flags()
        _train_each_kind(m.Device("cpu"), torch.Generator().manual_seed(5))
        assert _torch_flags() == before
    want = mpsnn_precision != "highest"
    assert set(seen) == {"conv2d", "conv_transpose2d", "linear", "mm", "convolution_backward"}
    for name, flags in seen.items():
        which = 1 if name in ("linear", "mm") else 0  # cuBLAS products, cuDNN convolutions
        assert [f[which] for f in flags] == [want] * len(flags), name


@pytest.mark.parametrize("user", [True, False], ids=["user-tf32-on", "user-tf32-off"])
def test_a_failing_library_call_inside_an_encode_restores_the_flags(
    monkeypatch: pytest.MonkeyPatch, user: bool
) -> None:
    _record_calls(monkeypatch, fail="conv2d")
    with torch_tf32(user):
        before = _torch_flags()
        with pytest.raises(Exception) as info:
            _train_each_kind(m.Device("cpu"), torch.Generator().manual_seed(6))
        assert "conv2d failed" in str(info.value) + str(info.value.__cause__)
        assert _torch_flags() == before


def test_the_guard_costs_little_host_time() -> None:
    """The added host time per call is small against any convolution's (a loose bound here:
    the measured numbers are in docs/semantics.md)."""
    import timeit

    x, op = torch.zeros(1), lambda a, b: None
    direct = min(timeit.repeat(lambda: op(x, 1), number=2000, repeat=5)) / 2000
    cpu = min(timeit.repeat(lambda: precision.float32_call(op, x, x, 1), number=2000, repeat=5))
    flip = min(
        timeit.repeat(lambda: precision._under_mode(op, (x, 1), "conv"), number=2000, repeat=5)
    )
    assert cpu / 2000 - direct < 5e-6 and flip / 2000 - direct < 2e-5


# -- on the GPU: float32 results under PyTorch's TF32 defaults ---------------------------------


def _rel(a: torch.Tensor, e: torch.Tensor) -> float:
    a, e = a.detach().double().cpu(), e.detach().double().cpu()
    return ((a - e).norm() / e.norm()).item()


def _conv_and_fc(seed: int) -> dict[str, float]:
    """Forward, data and weight gradients of a 64->64 3x3 convolution and a 1024->256 fully
    connected layer, encoded by mpsnn in float32 on CUDA (the same data for every call)."""
    dev = m.Device("cuda")
    out: dict[str, float] = {}
    for i, (name, desc, shape) in enumerate(
        [
            ("conv", m.ConvolutionDescriptor(3, 3, 64, 64), (4, 64, 16, 16)),
            ("fc", m.ConvolutionDescriptor(4, 4, 64, 256), (64, 64, 4, 4)),
        ]
    ):
        g = torch.Generator().manual_seed(seed + i)
        w = torch.randn(desc.weights_shape, generator=g) / (desc.kernel_width * 8)
        b = torch.randn(desc.output_feature_channels, generator=g)
        ds = m.TensorConvolutionDataSource(desc, w, b)
        x = m.Image.from_tensor(torch.randn(shape, generator=g).cuda())
        kernel = (m.Convolution if name == "conv" else m.FullyConnected)(dev, ds)
        gradient = (m.ConvolutionGradient if name == "conv" else m.FullyConnectedGradient)(dev, ds)
        cb = dev.new_command_queue().command_buffer()
        state = kernel.result_state(x)
        y = kernel.encode(cb, x, destination_state=state)
        gy = torch.randn(y.shape, generator=g).cuda()
        dx = gradient.encode(cb, m.Image.from_tensor(gy), x, state)
        run(cb)
        pad = 1 if name == "conv" else 0
        xr = x.tensor.double().cpu().requires_grad_()
        wr = w.permute(0, 3, 1, 2).double().requires_grad_()
        yr = F.conv2d(xr, wr, ds.bias_terms().double(), padding=pad)
        yr.backward(gy.double().cpu())
        out |= {
            f"{name} forward": _rel(y.tensor, yr),
            f"{name} data gradient": _rel(dx.tensor, xr.grad),
            f"{name} weight gradient": _rel(
                state.gradient_for_weights, wr.grad.permute(0, 2, 3, 1)
            ),
        }
    return out


@needs_cuda
def test_float32_convolution_and_fully_connected_are_float32_under_pytorchs_tf32() -> None:
    """PyTorch's flags allow TF32 (both of them): mpsnn's float32 is float32 all the same,
    within float32 rounding of float64; with mpsnn's TF32 allowed, the same data misses that
    bound by far where cuDNN and cuBLAS take TF32 kernels (so the check can fail)."""
    with torch_tf32(True):
        before = _torch_flags()
        strict = _conv_and_fc(31)
        m.set_float32_matmul_precision("high")
        loose = _conv_and_fc(31)
        assert _torch_flags() == before
    for what, err in strict.items():
        assert err <= 1e-5, f"{what}: relative error {err:.2e} in float32"
    # cuDNN picks TF32 kernels for this forward (its gradients' kernels may stay float32)
    for what in ("conv forward", "fc forward", "fc data gradient", "fc weight gradient"):
        assert loose[what] > 1e-4, f"{what}: TF32 relative error only {loose[what]:.2e}"


def _bn_network(dev: m.Device, fmt: m.FeatureChannelFormat, dtype: torch.dtype):
    """conv 3x3 16->32, batch norm, ReLU, conv 3x3 32->32, batch norm, ReLU, fully connected
    to 10, softmax cross entropy; SGD (learning rate 0.5) on every weight, gamma and beta."""
    gen = torch.Generator().manual_seed(41)
    sgd = m.SGD(dev, descriptor=m.OptimizerDescriptor(learning_rate=0.5))
    sources: list[Any] = []
    x = m.ImageNode("x")
    h = x
    for cin in (16, 32):
        desc = m.ConvolutionDescriptor(3, 3, cin, 32)
        w = torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64) / (9 * cin) ** 0.5
        sources.append(m.TensorConvolutionDataSource(desc, w.to(dtype), None, sgd))
        bn = m.TensorBatchNormalizationDataSource(
            32,
            gamma=(1 + 0.1 * torch.randn(32, generator=gen, dtype=torch.float64)).to(dtype),
            beta=(0.1 * torch.randn(32, generator=gen, dtype=torch.float64)).to(dtype),
            optimizer=sgd,
        )
        sources.append(bn)
        conv = m.ConvolutionNode(h, sources[-2])
        h = m.NeuronReLUNode(m.BatchNormalizationNode(conv.result_image, bn).result_image)
        h = h.result_image
    desc = m.ConvolutionDescriptor(8, 8, 32, 10)
    w = torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64) / 2048**0.5
    sources.append(
        m.TensorConvolutionDataSource(desc, w.to(dtype), torch.zeros(10, dtype=dtype), sgd)
    )
    loss = m.LossNode(
        m.FullyConnectedNode(h, sources[-1]).result_image,
        m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=1 / 16),
    )
    (exit_node,) = loss.training_graph()
    graph = m.Graph(dev, exit_node.result_image, False)
    graph.format = fmt
    return graph, sources


def _values(source: Any) -> list[torch.Tensor]:
    if isinstance(source, m.TensorBatchNormalizationDataSource):
        return [source.gamma(), source.beta()]
    b = source.bias_terms()
    return [source.weights()] + ([] if b is None else [b])


def _train_three_steps(dev: m.Device, fmt: m.FeatureChannelFormat, dtype: torch.dtype):
    """The network's values (weights, gamma, beta, biases) after three SGD steps, and how far
    the steps moved them (after - before), in float64 on the CPU."""
    graph, sources = _bn_network(dev, fmt, dtype)
    before = [t.detach().double().cpu().clone() for s in sources for t in _values(s)]
    gen = torch.Generator().manual_seed(42)
    q = dev.new_command_queue()
    for _ in range(3):
        x = torch.randn(16, 16, 8, 8, generator=gen, dtype=torch.float64).float()
        y = torch.randint(0, 10, (16, 1, 1), generator=gen)
        cb = q.command_buffer()
        labels = m.LossLabels(dev, y.to(dev.torch_device))
        images = [m.ImageBatch.from_tensor(x.to(device=dev.torch_device, dtype=dtype))]
        graph.encode_batch(cb, images, [labels])
        cb.commit()
        cb.wait_until_completed()
    after = [t.detach().double().cpu() for s in sources for t in _values(s)]
    return after, [a - b for a, b in zip(after, before, strict=True)]


def bn_network_errors() -> dict[str, list[float]]:
    """Per tensor, the relative errors against the float64 run of the float32 CUDA runs under
    PyTorch's TF32 flags: mpsnn's default ("weights", "steps") and mpsnn's TF32 ("tf32 ...")."""
    want, want_steps = _train_three_steps(
        m.Device("cpu"), m.FeatureChannelFormat.FLOAT64, torch.float64
    )
    out: dict[str, list[float]] = {}
    with torch_tf32(True):
        for name, p in (("", "highest"), ("tf32 ", "high")):
            m.set_float32_matmul_precision(p)
            got, steps = _train_three_steps(
                m.Device("cuda"), m.FeatureChannelFormat.FLOAT32, torch.float32
            )
            out[name + "weights"] = [_rel(a, e) for a, e in zip(got, want, strict=True)]
            out[name + "steps"] = [_rel(a, e) for a, e in zip(steps, want_steps, strict=True)]
    m.set_float32_matmul_precision("highest")
    return out


@needs_cuda
def test_three_sgd_steps_of_a_batch_normalized_network_are_float32_math() -> None:
    """After three SGD steps in float32 on CUDA with PyTorch's TF32 allowed, every weight,
    gamma, beta and bias is within 1e-5 (relative) of the float64 run, and the way the steps
    moved it within 2e-5 (2e-6 and less on an H200); with mpsnn's TF32 the weights miss by
    far (up to 2.5e-2 there)."""
    err = bn_network_errors()
    for i, e in enumerate(err["weights"]):
        assert e <= 1e-5, f"tensor {i}: relative error {e:.2e}"
    for i, e in enumerate(err["steps"]):
        assert e <= 2e-5, f"tensor {i}'s steps: relative error {e:.2e}"
    assert max(err["tf32 weights"]) > 1e-3, err["tf32 weights"]


@needs_cuda
def test_a_float32_reference_helper_turns_tf32_off_locally() -> None:
    """`tests.helpers.float32_reference` (used by the CUDA tests' PyTorch references)."""
    gen = torch.Generator().manual_seed(43)
    x = torch.randn(4, 64, 16, 16, generator=gen).cuda()
    w = torch.randn(64, 64, 3, 3, generator=gen).cuda() / 24
    exact = F.conv2d(x.double(), w.double(), padding=1)
    with torch_tf32(True):
        with float32_reference():
            strict = F.conv2d(x, w, padding=1)
        assert torch.backends.cudnn.allow_tf32
    assert_close(strict, exact, "float32 reference", tol=TOL[torch.float32] * 5)
