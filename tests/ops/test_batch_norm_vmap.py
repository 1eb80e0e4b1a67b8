"""`torch.func.vmap` over any argument of batch normalization's portable passes.

The passes update their own temporaries in place; under a ``torch.func`` transform they make
a new tensor per operation instead (`mpsnn.ops._functorch`), because vmap refuses an in-place
update of an unbatched temporary by a batched operand and has no batching rule for the ReLU
mask's comparison into a float tensor. Each mapped call must equal the loop of single calls."""

from __future__ import annotations

import pytest
import torch
from torch import func

from mpsnn.ops import batch_norm as bn
from mpsnn.ops import neuron as neuron_ops
from mpsnn.ops._functorch import under_transform
from mpsnn.ops.batch_norm_params import BatchNormParams as P
from mpsnn.ops.batch_norm_params import BatchNormSums as S
from mpsnn.ops.neuron import RELU, SIGMOID, NeuronParams, activation, activation_slope
from tests.helpers import assert_same_bits

F64 = torch.float64
NEURONS = {
    "none": None,
    "relu": NeuronParams(RELU, 0.0, 0.0, 0.0, None),
    "leaky": NeuronParams(RELU, 0.2, 0.0, 0.0, None),
    "sigmoid": NeuronParams(SIGMOID, 0.0, 0.0, 0.0, None),
}
N, C, H = 2, 4, 3  # one sub-batch
B = 3  # mapped over


def _args() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    return {
        "x": r(N, C, H, H), "g": r(N, C, H, H), "mean": r(C), "var": r(C).abs() + 0.5,
        "gamma": r(C), "beta": r(C), "sum_gy": r(C), "sum_gy_xhat": r(C),
    }  # fmt: skip


def _params(a: dict[str, torch.Tensor], neuron: NeuronParams | None) -> P:
    return P(a["mean"], a["var"], a["gamma"], a["beta"], 1e-5, neuron)


PASSES = {
    "statistics": (lambda a, n: torch.cat(bn.bn_statistics_portable(a["x"])), ["x"]),
    "forward": (lambda a, n: bn.bn_forward_portable(a["x"], _params(a, n)),
                ["x", "mean", "var", "gamma", "beta"]),
    "sums": (lambda a, n: torch.stack(bn.bn_gradient_sums_portable(a["g"], a["x"], _params(a, n))),
             ["g", "x", "mean", "var", "gamma", "beta"]),
    "backward": (
        lambda a, n: bn.bn_backward_portable(
            a["g"], a["x"], _params(a, n),
            S(a["sum_gy"], a["sum_gy_xhat"], torch.tensor([float(N * H * H)], dtype=F64)),
        ),
        ["g", "x", "mean", "var", "gamma", "beta", "sum_gy", "sum_gy_xhat"],
    ),
}  # fmt: skip
CASES = [
    (name, arg, neuron)
    for name, (_, args) in PASSES.items()
    for arg in args
    for neuron in (NEURONS if name != "statistics" else {"none": None})
]


@pytest.mark.parametrize(("name", "arg", "neuron"), CASES)
def test_vmap_over_each_argument_equals_the_loop(name: str, arg: str, neuron: str) -> None:
    fn, _ = PASSES[name]
    base = _args()
    scales = torch.tensor([1.0, 0.7, 1.3], dtype=F64).view(B, *([1] * base[arg].dim()))
    mapped = base[arg] * scales  # B different values of the mapped argument

    def one(v: torch.Tensor) -> torch.Tensor:
        return fn({**base, arg: v}, NEURONS[neuron])

    want = torch.stack([one(mapped[i]) for i in range(B)])
    got = func.vmap(one)(mapped)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_plain_relu_mask_maps_too() -> None:
    """The ReLU's forward and slope through its 1.0/0.0 mask, under vmap and outside."""
    relu = NEURONS["relu"]
    x = torch.randn(B, 5, 6, generator=torch.Generator().manual_seed(1), dtype=F64)
    x[0, 0, :3] = torch.tensor([0.0, -0.0, float("nan")], dtype=F64)
    for f in (activation, activation_slope):
        want = torch.stack([f(relu, x[i]) for i in range(B)])
        assert_same_bits(func.vmap(lambda v, f=f: f(relu, v))(x), want)


def test_under_transform_sees_the_transforms() -> None:
    assert not under_transform()
    seen: list[bool] = []

    def probe(v: torch.Tensor) -> torch.Tensor:
        seen.append(under_transform())
        return v.sum()

    x = torch.randn(3, 2, dtype=F64)
    func.vmap(probe)(x)
    func.grad(probe)(x[0])
    func.jvp(probe, (x[0],), (x[0],))
    assert seen == [True, True, True]
    assert not under_transform()


def test_forward_mode_ad_through_the_plain_relu() -> None:
    """Inside a forward-mode AD level the ReLU's mask takes its two-operation form (the
    comparison into a float tensor has no forward derivative)."""
    import torch.autograd.forward_ad as fwAD

    relu = NEURONS["relu"]
    gen = torch.Generator().manual_seed(2)
    x, t = torch.randn(4, 5, generator=gen, dtype=F64), torch.randn(4, 5, generator=gen, dtype=F64)
    with fwAD.dual_level():
        assert under_transform()
        y = activation(relu, fwAD.make_dual(x, t))
        primal, tangent = fwAD.unpack_dual(y)
    assert_same_bits(primal, activation(relu, x))
    assert_same_bits(tangent, (x >= 0).to(F64) * t)


def test_the_fast_paths_stand_aside_under_a_transform() -> None:
    """The Triton paths would be handed batched or dual tensors: under a transform `_runs`
    refuses every tensor, CUDA or not."""
    from types import SimpleNamespace

    from mpsnn.ops import triton as fast_paths

    cuda_like = SimpleNamespace(is_cuda=True)
    outside = fast_paths._runs(cuda_like)  # True where Triton imports (the dev setup has it)
    seen: list[bool] = []

    def probe(v: torch.Tensor) -> torch.Tensor:
        seen.append(fast_paths._runs(cuda_like))
        return v

    func.vmap(probe)(torch.zeros(2, 3))
    assert outside and seen == [False]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("neuron", list(NEURONS))
def test_the_new_tensor_forms_give_the_in_place_bits(dtype, layout, neuron, monkeypatch) -> None:
    """Outside a transform the passes update their temporaries in place; forced onto the
    forms a transform takes, they give the same bits (NaN, infinities and signed zeros
    included)."""
    a = _args()
    x = (a["x"] * 3).to(dtype).contiguous(memory_format=layout)
    g = a["g"].to(dtype).contiguous(memory_format=layout)
    x[0, 0, 0, :3] = torch.tensor([float("nan"), float("-inf"), -0.0], dtype=dtype)
    g[1, 1, 1, :2] = torch.tensor([float("inf"), -0.0], dtype=dtype)
    ct = torch.float64 if dtype == F64 else torch.float32
    p = P(*(a[k].to(ct) for k in ("mean", "var", "gamma", "beta")), 1e-5, NEURONS[neuron])
    sums = S(
        a["sum_gy"].to(ct), a["sum_gy_xhat"].to(ct), torch.tensor([float(N * H * H)], dtype=ct)
    )

    def run() -> list[torch.Tensor]:
        return [
            *bn.bn_statistics_portable(x),
            bn.bn_forward_portable(x, p),
            *bn.bn_gradient_sums_portable(g, x, p),
            bn.bn_backward_portable(g, x, p, sums),
        ]

    in_place = run()
    monkeypatch.setattr(bn, "under_transform", lambda: True)
    monkeypatch.setattr(neuron_ops, "under_transform", lambda: True)  # the ReLU mask's
    fresh = run()
    for want, got in zip(in_place, fresh, strict=True):
        assert got.stride() == want.stride()
        assert_same_bits(got, want)
