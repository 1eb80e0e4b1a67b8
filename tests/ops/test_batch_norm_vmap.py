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
