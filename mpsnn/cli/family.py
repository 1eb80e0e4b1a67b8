"""The pieces every ``mpsnn check`` family is built from: the configuration (`Config`), a run's
results (`Outcome`), and `Family`, the driver of a unary kernel and its gradient through the
window model, which the families in `mpsnn.cli.families` and `mpsnn.cli.families_more`
specialise.

A family's `run` builds fresh kernels on the requested device, encodes the forward into an
explicit destination sized by the kernel's padding policy (``destination_image_descriptor``,
which also sets ``offset``; ``--offset`` then replaces it, as a user would), and, given a
cotangent, the gradient kernel(s) on the same command buffer. Every run of a configuration is
therefore the same computation; only the dtype, device and input values change. A family
without a gradient kernel (``gradient`` None) runs the forward only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

import mpsnn.core
from mpsnn.cli.policies import describe_padding, padding_policy
from mpsnn.cli.references_geometry import Geometry
from mpsnn.cnn import (
    arithmetic,
    arithmetic_gradient,
    compare,
    convolution,
    correlation,
    dropout,
    gram,
    neuron,
    neuron_descriptor,
    normalization,
    pooling,
    reduce,
    resize,
    shape,
    softmax,
    upsampling,
)

__all__ = [
    "GEOMETRY",
    "HUGE",
    "Config",
    "Cotangent",
    "Family",
    "Outcome",
    "Values",
    "as_param",
    "cpu64",
    "m",
    "randn64",
    "run_buffer",
]

# The public mpsnn names the drivers use, by name (the command line names kernel classes; the
# cli layer imports the subpackages, not the package: tests/test_architecture.py).
_MODULES = (
    mpsnn.core, convolution, normalization, pooling, neuron, neuron_descriptor, softmax,
    upsampling, dropout, shape, arithmetic, arithmetic_gradient, compare, gram, reduce, correlation,
    resize,
)  # fmt: skip
m = SimpleNamespace(
    **{k: getattr(mod, k) for mod in _MODULES for k in getattr(mod, "__all__", vars(mod))}
)
HUGE = m.RECT_NO_CLIP.size.depth
Values = dict[str, torch.Tensor]
Cotangent = Callable[[tuple[int, ...]], torch.Tensor]


@dataclass(frozen=True)
class Config:
    """One check's configuration (the command line, with the family's defaults filled in)."""

    family: str
    size: tuple[int, int, int]  # W, H, C of the source
    batch: int = 2
    kernel: tuple[int, int] = (3, 3)  # x, y
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    out_channels: int = 4
    groups: int = 1
    offset: tuple[int, int, int] | None = None
    clip: tuple[int, int, int, int] | None = None
    edge_mode: m.EdgeMode | None = None
    padding: str | None = None
    sco: int = 0
    dco: int = 0
    destination_size: tuple[int, int] | None = None
    neuron: str = "relu"
    a: float | None = None
    b: float | None = None
    c: float | None = None
    scale: tuple[int, int] = (2, 2)
    align_corners: bool = False
    keep_probability: float = 0.5
    pad_before: tuple[int, int, int] = (1, 2, 0)
    pad_after: tuple[int, int, int] = (2, 1, 0)
    fill_value: float = 0.0
    secondary_size: tuple[int, int, int] | None = None
    alpha: float = 1.0
    comparison: str = "equal"
    threshold: float = 0.0
    op: str = "row-sum"
    weight: float = 1.0
    source_clip: tuple[int, int, int, int] | None = None
    window: tuple[int, int] = (1, 1)
    resize: tuple[int, int] = (11, 5)
    regions: tuple[tuple[float, float, float, float], ...] = (
        (0.1, 0.2, 0.6, 0.5),
        (0.8, 0.9, -0.5, -0.7),
        (-0.2, 0.3, 1.4, 0.5),
    )
    loss: str = "softmax-cross-entropy"
    reduction: str = "mean"
    reduce_across_batch: bool = False
    loss_weights: bool = False
    anchors: tuple[tuple[float, float], ...] = ((1.0, 2.0), (1.0, 1.0), (2.0, 1.0))
    classes: int = 2
    rescore: bool = True
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0

    @property
    def source_shape(self) -> tuple[int, int, int, int]:
        w, h, c = self.size
        return (self.batch, c, h, w)


@dataclass
class Outcome:
    """A run's results, as float64 CPU copies: the whole destination and each gradient."""

    y: torch.Tensor
    grads: dict[str, torch.Tensor]
    geometry: Geometry
    padding: str | None = None  # the policy the forward applied, in words


# -- helpers ---------------------------------------------------------------------------------------


def as_param(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Kernel parameters as a user gives them: float32 (the kernel casts), float64 for float64."""
    return t.to(torch.float64 if dtype == torch.float64 else torch.float32)


def cpu64(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.detach().to("cpu", torch.float64, copy=True)


def randn64(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def run_buffer(cb: m.CommandBuffer) -> None:
    cb.commit()
    cb.wait_until_completed()


# -- families --------------------------------------------------------------------------------

GEOMETRY = frozenset({"offset", "clip", "edge_mode", "sco", "dco", "destination_size"})


@dataclass
class Family:
    """A unary kernel family driven through the window model (subclasses override pieces)."""

    name: str
    forward: str  # mpsnn class names
    gradient: str | None  # None: forward only (MPS defines no gradient)
    options: frozenset[str] = GEOMETRY
    defaults: dict[str, Any] = field(default_factory=dict)
    linear: bool = True  # the forward is affine in each input (exact differences)
    reads_result: bool = False  # the gradient's source_image is the forward's result
    grad_names: tuple[str, ...] = ("x",)
    # The kernel's gradient is that of the sum of each image's output (a loss computing its own
    # gradient): the check's cotangent is one value per image, (N, 1, 1, 1), which scales each
    # image's gradient; that is the vector-Jacobian product of the cotangent broadcast over
    # the image, which the references and the adjoint test use.
    per_image_cotangent: bool = False

    # -- what subclasses provide -----------------------------------------------------------

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        """The float64 inputs: ``x`` (the source) and the kernel's parameters."""
        return {"x": randn64(cfg.source_shape, gen)}

    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        grad = None if self.gradient is None else getattr(m, self.gradient)(dev)
        return getattr(m, self.forward)(dev), grad

    def state_grads(self, state: Any) -> dict[str, torch.Tensor]:
        return {}

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        return {}

    def is_linear(self, cfg: Config, key: str) -> bool:
        return self.linear

    def channels_read(self, cfg: Config) -> int:
        return cfg.size[2] - cfg.sco

    def kernel_names(self, cfg: Config) -> tuple[str, str | None]:
        """The forward and gradient kernel classes this configuration runs."""
        return self.forward, self.gradient

    def gradient_inputs(self, cfg: Config) -> tuple[str, ...]:
        """The inputs this configuration checks a gradient of (``grad_names``, unless the
        configuration leaves one without a gradient)."""
        return self.grad_names

    def no_adjoint(self, cfg: Config) -> str | None:
        """Why this configuration's gradients have no adjoint test (None: they have one)."""
        return None

    def complete(self, values: dict[str, Any], given: set[str]) -> dict[str, Any]:
        """The command line's values (``given``: the options given) with what this family
        derives from them; raises ValueError for values that do not go together."""
        return values

    # -- the run -----------------------------------------------------------------------------

    def run(
        self,
        cfg: Config,
        values: Values,
        device: str,
        dtype: torch.dtype,
        cotangent: Cotangent | None = None,
    ) -> Outcome:
        dev = m.Device(device)
        p = {k: as_param(v, dtype) for k, v in values.items() if k != "x"}
        fwd, grad = self.kernels(cfg, dev, p)
        if cfg.padding is not None:
            fwd.padding = padding_policy(cfg.padding)
        if cfg.edge_mode is not None:
            fwd.edge_mode = cfg.edge_mode
        fwd.source_feature_channel_offset = cfg.sco
        fwd.destination_feature_channel_offset = cfg.dco
        fwd.offset = m.Offset(0, 0, cfg.offset[2] if cfg.offset else 0)
        src = m.Image.from_tensor(values["x"].to(device=device, dtype=dtype))
        n, c, h, w = fwd.destination_image_descriptor([src]).shape  # sets offset, maybe edge
        if cfg.offset is not None:
            fwd.offset = m.Offset(*cfg.offset)
        if cfg.clip is not None:
            x0, y0, cw, ch = cfg.clip
            fwd.clip_rect = m.Region(m.Origin(x0, y0, 0), m.Size(cw, ch, HUGE))
        if cfg.destination_size is not None:
            w, h = cfg.destination_size
        dst = m.Image.from_tensor(torch.zeros(n, cfg.dco + c, h, w, dtype=dtype, device=device))
        cb = dev.new_command_queue().command_buffer()
        state = fwd.result_state(src)
        fwd.encode(cb, src, dst, state)
        dx = None
        if cotangent is not None and grad is not None:
            g = m.Image.from_tensor(cotangent(dst.shape).to(device=device, dtype=dtype))
            dx = grad.encode(cb, g, dst if self.reads_result else src, state)
        run_buffer(cb)
        grads = {} if dx is None else {"x": cpu64(dx.tensor), **self.state_grads(state)}
        geometry = Geometry(
            source=tuple(src.shape), destination=tuple(dst.shape),  # type: ignore[arg-type]
            offset=tuple(fwd.offset), edge=fwd.edge_mode,  # type: ignore[arg-type]
            clipped=cfg.clip is not None, sco=cfg.sco, dco=cfg.dco,
            channels_read=self.channels_read(cfg), channels_written=c,
            kernel=(fwd.kernel_width, fwd.kernel_height),
            stride=(fwd.stride_in_pixels_x, fwd.stride_in_pixels_y),
            dilation=(fwd.dilation_rate_x, fwd.dilation_rate_y),
            params=self.params(cfg, fwd),
        )  # fmt: skip
        return Outcome(cpu64(dst.tensor), grads, geometry, describe_padding(fwd.padding))
