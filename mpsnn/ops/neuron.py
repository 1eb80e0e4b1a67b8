"""Neuron (activation) math: ``f(x)`` and ``f'(x)`` for the 16 MPS neuron types.

Types and derivatives (x is the neuron's input; at kinks the positive branch is taken where the
MPS header says ``x >= 0``, and clamp boundaries have derivative 0):

========== ================================ ==========================================
type       f(x)                             f'(x)
========== ================================ ==========================================
NONE       x                                1
RELU       x >= 0 ? x : a x                 x >= 0 ? 1 : a
LINEAR     a x + b                          a
SIGMOID    1 / (1 + e^-x)                   s (1 - s)
HARD_SIG.  clamp(a x + b, 0, 1)             a where 0 < a x + b < 1, else 0
TANH       a tanh(b x)                      a b (1 - tanh^2(b x))
ABSOLUTE   |x|                              sign(x) (0 at 0)
SOFT_PLUS  a log(1 + e^(b x))               a b sigmoid(b x)
SOFT_SIGN  x / (1 + |x|)                    1 / (1 + |x|)^2
ELU        x >= 0 ? x : a (e^x - 1)         x >= 0 ? 1 : a e^x
PRELU      x >= 0 ? x : a[c] x              x >= 0 ? 1 : a[c]
RELU_N     min(x >= 0 ? x : a x, b)         0 where that min is b, else RELU's
POWER      (a x + b)^c                      a c (a x + b)^(c - 1)
EXPONENTIAL c^(a x + b) (c = -1: e)         a ln(c) c^(a x + b)
LOGARITHM  log_c(a x + b) (c = -1: ln)      a / (ln(c) (a x + b))
GELU       x Phi(x)                         Phi(x) + x phi(x)
========== ================================ ==========================================

Domains: POWER with a non-integer ``c`` is real only where ``a x + b >= 0`` (NaN elsewhere, as
``torch.pow``); LOGARITHM needs ``a x + b > 0`` (``-inf`` at 0, NaN below). Inputs outside the
domain give what PyTorch gives; they are not errors.

RELU with ``a = +0.0`` (the plain ReLU) runs as ``(x >= 0) x`` and ``(x >= 0) g`` with the
general formulas' bits: two vectorized passes on the CPU, one Triton pass on CUDA for dense
float16/bfloat16/float32 tensors of one layout, else two launches (`plain_relu` decides and
says why).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mpsnn.ops import triton as fast_paths
from mpsnn.ops._dtypes import device_constant
from mpsnn.ops._functorch import under_transform

__all__ = [
    "NeuronParams",
    "activation",
    "activation_backward",
    "activation_slope",
    "neuron_derivative",
    "neuron_forward",
    "plain_relu",
    "relu_backward_of_result",
    "relu_in_place",
    "relu_mask_backward",
]

# Type codes match `mpsnn.cnn.neuron.NeuronType` (MPS MPSCNNNeuronType values).
NONE, RELU, LINEAR, SIGMOID, HARD_SIGMOID, TANH, ABSOLUTE, SOFT_PLUS = range(8)
SOFT_SIGN, ELU, PRELU, RELU_N, POWER, EXPONENTIAL, LOGARITHM, GELU = range(8, 16)

# Types whose formula loses precision in float16/bfloat16 arithmetic: computed in float32.
_TRANSCENDENTAL = frozenset(
    {SIGMOID, TANH, SOFT_PLUS, SOFT_SIGN, ELU, POWER, EXPONENTIAL, LOGARITHM, GELU}
)

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _channel_view(data: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-channel values shaped to broadcast over (N, C, H, W). Host slopes are copied to the
    device once per value (keyed by the values: the host copy may be edited in place)."""
    host = data
    if host.device != x.device:
        data = device_constant(("neuron-data", *host.tolist()), x.dtype, x.device, lambda: host)
    return data.to(dtype=x.dtype).view(1, -1, 1, 1)


def _log_base(c: float) -> float:
    return 1.0 if c == -1 else math.log(c)


def neuron_forward(
    kind: int, x: torch.Tensor, a: float, b: float, c: float, data: torch.Tensor | None
) -> torch.Tensor:
    """``f(x)`` for neuron type ``kind`` (see the module table)."""
    if kind == NONE:
        return x.clone()
    if kind == RELU:
        return torch.where(x >= 0, x, x * a)
    if kind == LINEAR:
        return x * a + b
    if kind == SIGMOID:
        return torch.sigmoid(x)
    if kind == HARD_SIGMOID:
        return (x * a + b).clamp_(0.0, 1.0)
    if kind == TANH:
        return torch.tanh(x * b) * a
    if kind == ABSOLUTE:
        return x.abs()
    if kind == SOFT_PLUS:
        return F.softplus(x * b) * a
    if kind == SOFT_SIGN:
        return x / (1 + x.abs())
    if kind == ELU:
        return torch.where(x >= 0, x, torch.expm1(x) * a)
    if kind == PRELU:
        assert data is not None  # checked by NeuronDescriptor
        return torch.where(x >= 0, x, x * _channel_view(data, x))
    if kind == RELU_N:
        return torch.where(x >= 0, x, x * a).clamp_(max=b)
    if kind == POWER:
        return torch.pow(x * a + b, c)
    if kind == EXPONENTIAL:
        return torch.exp((x * a + b) * _log_base(c))
    if kind == LOGARITHM:
        return torch.log(x * a + b) / _log_base(c)
    if kind == GELU:
        return x * 0.5 * (1 + torch.erf(x * _INV_SQRT2))
    raise ValueError(f"[Neuron] neuron type must be 0..15, got {kind}")


def neuron_derivative(
    kind: int, x: torch.Tensor, a: float, b: float, c: float, data: torch.Tensor | None
) -> torch.Tensor:
    """``f'(x)`` for neuron type ``kind`` (see the module table)."""
    if kind in (NONE, LINEAR):
        return torch.full_like(x, 1.0 if kind == NONE else a)
    if kind == RELU:
        return (x >= 0).to(x.dtype) * (1 - a) + a  # scalars keep x's dtype (no float32 a)
    if kind == SIGMOID:
        s = torch.sigmoid(x)
        return s * (1 - s)
    if kind == HARD_SIGMOID:
        z = x * a + b
        return ((z > 0) & (z < 1)).to(x.dtype) * a
    if kind == TANH:
        t = torch.tanh(x * b)
        return (1 - t * t) * (a * b)
    if kind == ABSOLUTE:
        return torch.sign(x)
    if kind == SOFT_PLUS:
        return torch.sigmoid(x * b) * (a * b)
    if kind == SOFT_SIGN:
        d = 1 + x.abs()
        return 1 / (d * d)
    if kind == ELU:
        return torch.where(x >= 0, 1.0, torch.exp(x) * a).to(x.dtype)
    if kind == PRELU:
        assert data is not None
        return torch.where(x >= 0, torch.ones_like(x), _channel_view(data, x).expand_as(x))
    if kind == RELU_N:
        leaky = torch.where(x >= 0, x, x * a)
        slope = (x >= 0).to(x.dtype) * (1 - a) + a
        return slope * (leaky < b).to(x.dtype)
    if kind == POWER:
        return torch.pow(x * a + b, c - 1) * (a * c)
    if kind == EXPONENTIAL:
        lc = _log_base(c)
        return torch.exp((x * a + b) * lc) * (a * lc)
    if kind == LOGARITHM:
        return a / ((x * a + b) * _log_base(c))
    if kind == GELU:
        cdf = 0.5 * (1 + torch.erf(x * _INV_SQRT2))
        return cdf + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI
    raise ValueError(f"[NeuronGradient] neuron type must be 0..15, got {kind}")


class NeuronParams(NamedTuple):
    """A neuron as the math needs it: type code, parameters and PRELU slopes (or None)."""

    kind: int
    a: float
    b: float
    c: float
    data: torch.Tensor | None


def _upcast(p: NeuronParams, x: torch.Tensor) -> torch.Tensor:
    if p.kind in _TRANSCENDENTAL and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


# -- the plain ReLU fast path ----------------------------------------------------------------


def plain_relu(p: NeuronParams, x: torch.Tensor) -> bool:
    """The one place that picks the ReLU fast path: RELU with ``a = +0.0`` on floating-point
    ``x``. There, with ``m = (x >= 0)`` as 1.0/0.0 in ``x``'s dtype:

    * ``m x`` is bit for bit the general ``where(x >= 0, x, x a)``: ``1 x = x`` (-0, inf
      included), ``0 x = x 0.0`` for ``x < 0`` (-0.0; NaN for -inf), and a NaN fails
      ``x >= 0`` in both (``0 NaN`` is that NaN);
    * ``m`` is bit for bit the general slope ``m (1 - a) + a`` (``m 1 + 0 = m``), so
      ``m g = g m``.

    ``a = -0.0`` keeps the general path: there ``x a`` is +0.0 for ``x < 0``, ``m x`` -0.0.
    Why: the general forms take 3 to 5 passes, where (and mixed bool-float products) are not
    vectorized; these take 2 vectorized passes, on the CPU and on CUDA (where ``x * (x >= 0)``
    with a bool mask runs as a non-vectorized kernel at half the bandwidth: 0.45 ms of a
    ResNet-18 step at batch 512 on an H100), or one Triton pass on CUDA (`_relu_times`).
    """
    return p.kind == RELU and p.a == 0.0 and math.copysign(1.0, p.a) > 0 and x.is_floating_point()


def _nonnegative(x: torch.Tensor) -> torch.Tensor:
    """``(x >= 0)`` as 1.0/0.0 in ``x``'s dtype, a new tensor, in one pass (two under a
    ``torch.func`` transform: the comparison into a float tensor has no batching rule)."""
    if under_transform():
        return (x >= 0).to(x.dtype)
    return torch.ge(x, 0, out=torch.empty_like(x))


def _times(m: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``m t`` into ``m`` (a new tensor of ours) when the shapes are equal, outside a
    ``torch.func`` transform (`mpsnn.ops._functorch`)."""
    return m.mul_(t) if m.shape == t.shape and not under_transform() else m * t


def _relu_times(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``(x >= 0) t``, a new tensor, through a 1.0/0.0 mask in ``x``'s dtype (see
    `plain_relu`); on CUDA one Triton pass with the same bits (`mpsnn.ops.triton.relu_times`:
    one launch and one read of each input, where the mask takes two launches and a round
    trip through memory)."""
    fast = fast_paths.relu_times(x, t)
    if fast is not None:
        return fast
    return _times(_nonnegative(x), t)


def activation(p: NeuronParams, x: torch.Tensor) -> torch.Tensor:
    """``f(x)`` in ``x``'s dtype (transcendental types computed in float32)."""
    if plain_relu(p, x):
        return _relu_times(x, x)
    return neuron_forward(p.kind, _upcast(p, x), p.a, p.b, p.c, p.data).to(x.dtype)


def activation_slope(p: NeuronParams, x: torch.Tensor) -> torch.Tensor:
    """``f'(x)`` in ``x``'s dtype (transcendental types computed in float32)."""
    if plain_relu(p, x):
        return _nonnegative(x)
    return neuron_derivative(p.kind, _upcast(p, x), p.a, p.b, p.c, p.data).to(x.dtype)


def relu_backward_of_result(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``g * relu'(x)`` of the plain ReLU from its *result* ``y = relu(x)``: ``g`` where
    ``y > 0``, else 0, in ``g``'s dtype (one pass: PyTorch's ``threshold_backward``).

    ``y > 0`` exactly where ``x > 0`` (with ``y`` in a format at least as wide as ``x``'s), so
    this is the source rule (``x >= 0``, the MPS header's) everywhere except at ``x = 0``, where
    it takes the other subgradient of the ReLU, 0 (as PyTorch does), and at a NaN ``x`` (a NaN
    ``y``), where ``g`` passes instead of 0. Reading the result lets a graph free the ReLU's
    input right after the forward (the result is kept for the next layer anyway).
    """
    if y.dtype != g.dtype:
        y = y.to(g.dtype)  # only compared with 0: the same sign in any floating dtype
    return torch.ops.aten.threshold_backward(g, y, 0)


def relu_in_place(p: NeuronParams, z: torch.Tensor) -> torch.Tensor | None:
    """The plain ReLU of a CPU ``z`` written over ``z`` (a new tensor of the caller's, whose
    values it needs no more), returning its slope ``m = (z >= 0)`` (1.0/0.0 in ``z``'s dtype,
    a new tensor); None, with ``z`` untouched, unless `plain_relu` holds for a CPU ``z``.

    For a caller that would keep ``z`` only to differentiate the ReLU: keeping ``m`` instead,
    `relu_mask_backward` gives `activation_backward`'s bits (``z m = m z``, and the slope is
    ``m`` itself) in one pass where that takes two. CUDA keeps ``z`` (its Triton pass reads it
    once)."""
    if z.device.type != "cpu" or not plain_relu(p, z):
        return None
    m = _nonnegative(z)
    z.mul_(m)
    return m


def relu_mask_backward(g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``g f'(z)`` of the plain ReLU from its slope ``m`` (`relu_in_place`), in ``g``'s dtype:
    `activation_backward`'s arithmetic for that neuron (``m g``, widened to the wider dtype
    when they differ), a new tensor."""
    if g.dtype != m.dtype:
        wide = torch.promote_types(g.dtype, m.dtype)
        return (g.to(wide) * m.to(wide)).to(g.dtype)
    return m * g


def activation_backward(p: NeuronParams, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g * f'(x)``: the gradient of the neuron's input, in ``g``'s dtype."""
    if g.dtype != x.dtype:
        wide = torch.promote_types(g.dtype, x.dtype)
        return (g.to(wide) * activation_slope(p, x.to(wide))).to(g.dtype)
    if plain_relu(p, x):
        return _relu_times(x, g)
    return g * activation_slope(p, x)
