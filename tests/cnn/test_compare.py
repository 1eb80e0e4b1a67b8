"""Compare: every comparison type against PyTorch's comparisons (ties, NaN, infinities), the
threshold against a loop-level formula, the arithmetic machinery it inherits (broadcast strides,
scales, bias, clamp, offsets), batches, every storage format, no gradient, and the errors."""

from __future__ import annotations

import math

import pytest
import torch

import mpsnn as m
from tests.helpers import DEVICES, assert_close, run

TORCH = {
    m.ComparisonType.EQUAL: torch.eq,
    m.ComparisonType.NOT_EQUAL: torch.ne,
    m.ComparisonType.LESS: torch.lt,
    m.ComparisonType.LESS_OR_EQUAL: torch.le,
    m.ComparisonType.GREATER: torch.gt,
    m.ComparisonType.GREATER_OR_EQUAL: torch.ge,
}


def _compare(dev, x, y, kind, threshold=0.0, configure=None, batch=False):
    k = m.Compare(dev)
    k.comparison_type = kind
    k.threshold = threshold
    if configure:
        configure(k)
    cb = dev.new_command_queue().command_buffer()
    if batch:
        out = k.encode_batch(cb, m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(y)).image
    else:
        out = k.encode(cb, m.Image.from_tensor(x), m.Image.from_tensor(y))
    run(cb)
    return out.tensor


def test_enum_values_are_mps() -> None:
    assert [(t.name, t.value) for t in m.ComparisonType] == [
        ("EQUAL", 0), ("NOT_EQUAL", 1), ("LESS", 2), ("LESS_OR_EQUAL", 3), ("GREATER", 4),
        ("GREATER_OR_EQUAL", 5),
    ]  # fmt: skip
    assert m.Compare(m.Device("cpu")).comparison_type is m.ComparisonType.EQUAL


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str
)
@pytest.mark.parametrize("kind", list(m.ComparisonType), ids=lambda k: k.name)
@pytest.mark.parametrize("batch", [False, True])
def test_matches_torch_comparisons(kind, dtype, batch, device) -> None:
    gen = torch.Generator().manual_seed(10)
    # few distinct values: many ties; plus NaN and infinities
    x = torch.randint(-2, 3, (2, 3, 4, 5), generator=gen).to(torch.float64)
    y = torch.randint(-2, 3, (2, 3, 4, 5), generator=gen).to(torch.float64)
    x[0, 0, 0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    y[0, 0, 0, :3] = torch.tensor([1.0, math.inf, math.inf])
    x, y = x.to(dtype), y.to(dtype)
    z = _compare(m.Device(device), x.to(device), y.to(device), kind, batch=batch)
    assert z.dtype == dtype
    assert torch.equal(z.cpu(), TORCH[kind](x, y).to(dtype))


@pytest.mark.parametrize("kind", list(m.ComparisonType), ids=lambda k: k.name)
def test_threshold_against_loop_formula(kind) -> None:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, 2, 3, 7, generator=gen, dtype=torch.float64)
    y = x + torch.randn(x.shape, generator=gen, dtype=torch.float64) * 0.3
    y[0, 0, 0, 0] = x[0, 0, 0, 0] + 0.25  # exactly at the threshold: equal
    t = 0.25
    z = _compare(m.Device("cpu"), x, y, kind, threshold=t)
    want = torch.empty_like(x)
    for idx in range(x.numel()):
        a, b = x.view(-1)[idx].item(), y.view(-1)[idx].item()
        eq = a == b or abs(a - b) <= t
        r = {
            m.ComparisonType.EQUAL: eq,
            m.ComparisonType.NOT_EQUAL: not eq,
            m.ComparisonType.LESS: a < b and not eq,
            m.ComparisonType.LESS_OR_EQUAL: a <= b or eq,
            m.ComparisonType.GREATER: a > b and not eq,
            m.ComparisonType.GREATER_OR_EQUAL: a >= b or eq,
        }[kind]
        want.view(-1)[idx] = float(r)
    assert torch.equal(z, want)
    assert 0 < want.sum() < want.numel()  # both outcomes occur


def test_arithmetic_machinery_broadcast_scales_bias_clamp_offsets() -> None:
    gen = torch.Generator().manual_seed(12)
    dev = m.Device("cpu")
    x = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(2, 1, 1, 5, generator=gen, dtype=torch.float64)  # a row per image

    def configure(k):
        k.secondary_stride_in_feature_channels = 0
        k.secondary_stride_in_pixels_y = 0
        k.primary_scale, k.secondary_scale, k.bias = 2.0, -1.5, 0.25
        k.maximum_value = 1.0

    z = _compare(dev, x, y, m.ComparisonType.GREATER, configure=configure)
    want = ((2.0 * x > -1.5 * y).double() + 0.25).clamp(max=1.0)
    assert_close(z, want, "compare with broadcast, scales, bias, clamp", tol=0)

    # offsets and ZERO edges: x read from (1, 0), y from (0, 1) into a given destination
    k = m.Compare(dev)
    k.comparison_type = m.ComparisonType.LESS_OR_EQUAL
    k.primary_offset = m.Offset(1, 0, 0)
    k.secondary_offset = m.Offset(0, 1, 0)
    k.clip_rect = m.Region.make(0, 0, 4, 3)
    y2 = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    dst = torch.full((2, 3, 4, 5), 7.0, dtype=torch.float64)
    cb = dev.new_command_queue().command_buffer()
    out = k.encode_batch(
        cb,
        m.ImageBatch.from_tensor(x),
        m.ImageBatch.from_tensor(y2),
        m.ImageBatch.from_tensor(dst.clone()),
    ).image
    run(cb)
    want = dst.clone()
    want[:, :, 0:3, 0:4] = (x[:, :, 0:3, 1:5] <= y2[:, :, 1:4, 0:4]).double()
    assert torch.equal(out.tensor, want)


def test_no_gradient_no_state_and_errors() -> None:
    dev = m.Device("cpu")
    k = m.Compare(dev)
    assert m.gradient_kernels_of(m.Compare) == ()
    src = m.Image.from_tensor(torch.zeros(1, 1, 2, 2))
    assert k.result_state(src, src) is None
    assert k.result_state_batch(m.ImageBatch(src), m.ImageBatch(src)) is None
    assert not k.is_state_modified
    cb = dev.new_command_queue().command_buffer()
    assert k.temporary_result_state(cb, src, src) is None
    with pytest.raises(
        ValueError,
        match=r"\[Compare\] a comparison has no gradient \(MPS defines none\), so no destination "
        r"state: it must be None, got a state",
    ):
        k.encode(cb, src, src, None, m.ArithmeticGradientState(dev))
    with pytest.raises(ValueError, match=r"\[Compare\] a comparison has no gradient"):
        k.encode_batch(
            cb, m.ImageBatch(src), m.ImageBatch(src), None, [m.ArithmeticGradientState(dev)]
        )
    with pytest.raises(
        TypeError, match=r"\[Compare\] comparison_type must be a ComparisonType, got int"
    ):
        k.comparison_type = 1
    with pytest.raises(TypeError, match=r"\[Compare\] threshold must be a number, got str"):
        k.threshold = "0"
    with pytest.raises(
        ValueError, match=r"\[Compare\] threshold must be finite and >= 0, got -0.5"
    ):
        k.threshold = -0.5
    with pytest.raises(ValueError, match=r"\[Compare\] threshold must be finite and >= 0, got nan"):
        k.threshold = math.nan
    with pytest.raises(
        ValueError, match=r"\[Compare\] the sources' widths cannot broadcast: 2 and 3"
    ):
        k.encode(cb, src, m.Image.from_tensor(torch.zeros(1, 1, 2, 3)))


def test_configuration_is_taken_at_encode() -> None:
    dev = m.Device("cpu")
    x = torch.tensor([[[[1.0, 2.0, 3.0]]]], dtype=torch.float64)
    y = torch.tensor([[[[2.0, 2.0, 2.0]]]], dtype=torch.float64)
    k = m.Compare(dev)
    k.comparison_type = m.ComparisonType.LESS
    cb = dev.new_command_queue().command_buffer()
    first = k.encode(cb, m.Image.from_tensor(x), m.Image.from_tensor(y))
    k.comparison_type = m.ComparisonType.GREATER  # changed before the buffer runs
    second = k.encode(cb, m.Image.from_tensor(x), m.Image.from_tensor(y))
    run(cb)
    assert first.tensor.flatten().tolist() == [1.0, 0.0, 0.0]
    assert second.tensor.flatten().tolist() == [0.0, 0.0, 1.0]
