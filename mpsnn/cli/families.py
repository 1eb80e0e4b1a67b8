"""How ``mpsnn check`` drives each kernel family: its inputs, one forward + gradient run, and
what the run resolved (`Geometry`, for the PyTorch references in `mpsnn.cli.references`).

A family's `run` builds fresh kernels on the requested device, encodes the forward into an
explicit destination sized by the kernel's padding policy (``destination_image_descriptor``,
which also sets ``offset``; ``--offset`` then replaces it, as a user would), and, given a
cotangent, the gradient kernel(s) on the same command buffer. Every run of a configuration is
therefore the same computation; only the dtype, device and input values change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

import mpsnn.core
from mpsnn.cli.policies import describe_padding, padding_policy
from mpsnn.cli.references import Geometry
from mpsnn.cnn import (
    arithmetic,
    arithmetic_gradient,
    convolution,
    dropout,
    neuron,
    neuron_descriptor,
    normalization,
    pooling,
    shape,
    softmax,
    upsampling,
)

__all__ = [
    "FAMILIES",
    "NEURON_TYPES",
    "Config",
    "Family",
    "Outcome",
    "make_config",
]

# The public mpsnn names the drivers use, by name (the command line names kernel classes; the
# cli layer imports the subpackages, not the package: tests/test_architecture.py).
_MODULES = (
    mpsnn.core, convolution, normalization, pooling, neuron, neuron_descriptor, softmax,
    upsampling, dropout, shape, arithmetic, arithmetic_gradient,
)  # fmt: skip
m = SimpleNamespace(
    **{k: getattr(mod, k) for mod in _MODULES for k in getattr(mod, "__all__", vars(mod))}
)
_HUGE = m.RECT_NO_CLIP.size.depth
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


def _param(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Kernel parameters as a user gives them: float32 (the kernel casts), float64 for float64."""
    return t.to(torch.float64 if dtype == torch.float64 else torch.float32)


def _out(t: torch.Tensor | None) -> torch.Tensor:
    assert t is not None
    return t.detach().to("cpu", torch.float64, copy=True)


def _randn(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _run_buffer(cb: m.CommandBuffer) -> None:
    cb.commit()
    cb.wait_until_completed()


# -- families --------------------------------------------------------------------------------

GEOMETRY = frozenset({"offset", "clip", "edge_mode", "sco", "dco", "destination_size"})


@dataclass
class Family:
    """A unary kernel family driven through the window model (subclasses override pieces)."""

    name: str
    forward: str  # mpsnn class names
    gradient: str
    options: frozenset[str] = GEOMETRY
    defaults: dict[str, Any] = field(default_factory=dict)
    linear: bool = True  # the forward is affine in each input (exact differences)
    reads_result: bool = False  # the gradient's source_image is the forward's result
    grad_names: tuple[str, ...] = ("x",)

    # -- what subclasses provide -----------------------------------------------------------

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        """The float64 inputs: ``x`` (the source) and the kernel's parameters."""
        return {"x": _randn(cfg.source_shape, gen)}

    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        return getattr(m, self.forward)(dev), getattr(m, self.gradient)(dev)

    def state_grads(self, state: Any) -> dict[str, torch.Tensor]:
        return {}

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        return {}

    def is_linear(self, cfg: Config, key: str) -> bool:
        return self.linear

    def channels_read(self, cfg: Config) -> int:
        return cfg.size[2] - cfg.sco

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
        p = {k: _param(v, dtype) for k, v in values.items() if k != "x"}
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
            fwd.clip_rect = m.Region(m.Origin(x0, y0, 0), m.Size(cw, ch, _HUGE))
        if cfg.destination_size is not None:
            w, h = cfg.destination_size
        dst = m.Image.from_tensor(torch.zeros(n, cfg.dco + c, h, w, dtype=dtype, device=device))
        cb = dev.new_command_queue().command_buffer()
        state = fwd.result_state(src)
        fwd.encode(cb, src, dst, state)
        dx = None
        if cotangent is not None:
            g = m.Image.from_tensor(cotangent(dst.shape).to(device=device, dtype=dtype))
            dx = grad.encode(cb, g, dst if self.reads_result else src, state)
        _run_buffer(cb)
        grads = {} if dx is None else {"x": _out(dx.tensor), **self.state_grads(state)}
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
        return Outcome(_out(dst.tensor), grads, geometry, describe_padding(fwd.padding))


@dataclass
class _Convolution(Family):
    grad_names: tuple[str, ...] = ("x", "weights", "bias")

    def descriptor(self, cfg: Config) -> m.ConvolutionDescriptor:
        (kw, kh), (sx, sy), (dx, dy) = cfg.kernel, cfg.stride, cfg.dilation
        cin = self.channels_read(cfg)
        return m.ConvolutionDescriptor(kw, kh, cin, cfg.out_channels, sx, sy, dx, dy, cfg.groups)

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        x = _randn(cfg.source_shape, gen)
        o, kh, kw, ig = self.descriptor(cfg).weights_shape
        scale = (kh * kw * ig) ** -0.5
        return {"x": x, "weights": _randn((o, kh, kw, ig), gen) * scale, "bias": _randn((o,), gen)}

    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        ds = m.TensorConvolutionDataSource(self.descriptor(cfg), p["weights"], p["bias"])
        return getattr(m, self.forward)(dev, ds), getattr(m, self.gradient)(dev, ds)

    def state_grads(self, state: Any) -> dict[str, torch.Tensor]:
        return {
            "weights": _out(state.gradient_for_weights),
            "bias": _out(state.gradient_for_biases),
        }

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        koff = (getattr(fwd, "kernel_offset_x", 0), getattr(fwd, "kernel_offset_y", 0))
        return {"groups": cfg.groups, "kernel_offset": koff}


@dataclass
class _FullyConnected(_Convolution):
    def descriptor(self, cfg: Config) -> m.ConvolutionDescriptor:
        kw, kh = cfg.kernel
        return m.ConvolutionDescriptor(kw, kh, self.channels_read(cfg), cfg.out_channels)


@dataclass
class _Pooling(Family):
    linear: bool = False

    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        (kw, kh), (sx, sy), (dx, dy) = cfg.kernel, cfg.stride, cfg.dilation
        args = (kw, kh, dx, dy, sx, sy) if self.name == "dilated-pooling-max" else (kw, kh, sx, sy)
        return getattr(m, self.forward)(dev, *args), getattr(m, self.gradient)(dev, *args)

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        method = int(fwd.padding.padding_method)
        return {"exclude_edges": bool(method & m.PaddingMethod.EXCLUDE_EDGES)}


NEURON_TYPES = {t.name.lower().replace("_", "-"): t for t in m.NeuronType}


@dataclass
class _Neuron(Family):
    def descriptor(self, cfg: Config, slopes: torch.Tensor | None) -> m.NeuronDescriptor:
        kind = NEURON_TYPES[cfg.neuron]
        return m.NeuronDescriptor(kind, cfg.a, cfg.b, cfg.c, slopes)

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        x = _randn(cfg.source_shape, gen)
        values = {"x": x}
        if cfg.neuron == "prelu":
            slopes = _randn((self.channels_read(cfg),), gen) * 0.5
            values["slopes"] = slopes.float().double()  # the descriptor keeps float32
        d = self.descriptor(cfg, values.get("slopes"))
        if cfg.neuron in ("power", "logarithm") and d.a != 0:  # inside the domain: a x + b > 0
            u = torch.rand(cfg.source_shape, generator=gen, dtype=torch.float64) * 2 + 0.5
            values["x"] = (u - d.b) / d.a
        return values

    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        d = self.descriptor(cfg, p.get("slopes"))
        return m.Neuron(dev, d), m.NeuronGradient(dev, d)

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        d = fwd.neuron_descriptor
        return {"neuron": d.neuron_type.name, "a": d.a, "b": d.b, "c": d.c}

    def is_linear(self, cfg: Config, key: str) -> bool:
        return cfg.neuron in ("none", "linear")


@dataclass
class _Upsampling(Family):
    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        sx, sy = cfg.scale
        if self.name == "upsampling-bilinear":
            fwd = m.UpsamplingBilinear(dev, sx, sy, cfg.align_corners)
        else:
            fwd = m.UpsamplingNearest(dev, sx, sy)
        return fwd, getattr(m, self.gradient)(dev, sx, sy)

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        bilinear = self.name == "upsampling-bilinear"
        return {"scale": cfg.scale, "bilinear": bilinear, "align_corners": cfg.align_corners}


@dataclass
class _GroupNorm(Family):
    linear: bool = False
    grad_names: tuple[str, ...] = ("x", "gamma", "beta")

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        c = self.channels_read(cfg)
        return {
            "x": _randn(cfg.source_shape, gen) * 2 + 0.5,
            "gamma": torch.rand(c, generator=gen, dtype=torch.float64) + 0.5,
            "beta": _randn((c,), gen),
        }

    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        c = self.channels_read(cfg)
        if self.name == "instance-normalization":
            ds = m.TensorInstanceNormalizationDataSource(c, p["gamma"], p["beta"], epsilon=1e-5)
            return m.InstanceNormalization(dev, ds), m.InstanceNormalizationGradient(dev)
        ds = m.TensorGroupNormalizationDataSource(c, cfg.groups, p["gamma"], p["beta"], 1e-5)
        return m.GroupNormalization(dev, ds), m.GroupNormalizationGradient(dev)

    def state_grads(self, state: Any) -> dict[str, torch.Tensor]:
        return {"gamma": _out(state.gradient_for_gamma), "beta": _out(state.gradient_for_beta)}

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        instance = self.name == "instance-normalization"
        return {"epsilon": 1e-5, "groups": cfg.groups, "instance": instance}


@dataclass
class _Dropout(Family):
    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        keep, seed = cfg.keep_probability, cfg.seed
        return m.Dropout(dev, keep, seed=seed), m.DropoutGradient(dev, keep, seed=seed)


@dataclass
class _Pad(Family):
    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        before, after = m.ImageCoordinate(*cfg.pad_before), m.ImageCoordinate(*cfg.pad_after)
        return m.Pad(dev, before, after, fill_value=cfg.fill_value), m.PadGradient(dev)

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        return {"before": cfg.pad_before, "after": cfg.pad_after, "fill": cfg.fill_value}


@dataclass
class _BatchNorm(Family):
    """The MPS training sequence: statistics, forward, statistics gradient, gradient."""

    options: frozenset[str] = frozenset()
    linear: bool = False
    grad_names: tuple[str, ...] = ("x", "gamma", "beta")
    inputs = _GroupNorm.inputs

    def run(
        self,
        cfg: Config,
        values: Values,
        device: str,
        dtype: torch.dtype,
        cotangent: Cotangent | None = None,
    ) -> Outcome:
        dev = m.Device(device)
        c = cfg.size[2]
        gamma, beta = _param(values["gamma"], dtype), _param(values["beta"], dtype)
        ds = m.TensorBatchNormalizationDataSource(c, gamma, beta, epsilon=1e-5)
        bn = m.BatchNormalization(dev, ds)
        xb = m.ImageBatch.from_tensor(values["x"].to(device=device, dtype=dtype))
        state = bn.result_state(xb[0])
        cb = dev.new_command_queue().command_buffer()
        m.BatchNormalizationStatistics(dev).encode_batch(cb, xb, state)
        y = bn.encode_batch(cb, xb, state)
        dx = None
        if cotangent is not None:
            gb = m.ImageBatch.from_tensor(cotangent(y.shape).to(device=device, dtype=dtype))
            m.BatchNormalizationStatisticsGradient(dev).encode_batch(cb, gb, xb, state)
            dx = m.BatchNormalizationGradient(dev).encode_batch(cb, gb, xb, state)
        _run_buffer(cb)
        grads = {}
        if dx is not None:
            grads = {
                "x": _out(dx.tensor),
                "gamma": _out(state.gradient_for_gamma),
                "beta": _out(state.gradient_for_beta),
            }
        shape = tuple(xb.shape)
        geometry = Geometry(
            shape,
            shape,
            (0, 0, 0),
            m.EdgeMode.ZERO,
            False,
            0,
            0,
            c,
            c,  # type: ignore[arg-type]
            params={"epsilon": 1e-5},
        )
        return Outcome(_out(y.tensor), grads, geometry)


_OPS = {"add": "+", "subtract": "-", "multiply": "*", "divide": "/"}


@dataclass
class _Arithmetic(Family):
    """Primary ``x`` and secondary ``y``; a secondary dimension of 1 broadcasts (stride 0)."""

    options: frozenset[str] = frozenset(
        {"secondary_size", "offset", "clip", "edge_mode", "dco", "destination_size"}
    )
    grad_names: tuple[str, ...] = ("x", "y")

    def secondary_shape(self, cfg: Config) -> tuple[int, int, int, int]:
        w, h, c = cfg.secondary_size or cfg.size
        return (cfg.batch, c, h, w)

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        x = _randn(cfg.source_shape, gen)
        y = _randn(self.secondary_shape(cfg), gen)
        if self.name == "divide":  # keep the divisor away from 0
            y = torch.where(y < 0, y - 0.5, y + 0.5)
        return {"x": x, "y": y}

    def is_linear(self, cfg: Config, key: str) -> bool:
        return not (self.name == "divide" and key == "y")

    def run(
        self,
        cfg: Config,
        values: Values,
        device: str,
        dtype: torch.dtype,
        cotangent: Cotangent | None = None,
    ) -> Outcome:
        dev = m.Device(device)
        x, y = (values[k].to(device=device, dtype=dtype) for k in ("x", "y"))
        kernel = getattr(m, self.forward)(dev)
        p_shape, s_shape = tuple(x.shape), tuple(y.shape)
        for name, i in (("feature_channels", 1), ("pixels_y", 2), ("pixels_x", 3)):
            if s_shape[i] == 1 and p_shape[i] > 1:
                setattr(kernel, f"secondary_stride_in_{name}", 0)
        if cfg.offset is not None:
            kernel.primary_offset = m.Offset(*cfg.offset)
        if cfg.edge_mode is not None:
            kernel.primary_edge_mode = kernel.secondary_edge_mode = cfg.edge_mode
        if cfg.clip is not None:
            x0, y0, cw, ch = cfg.clip
            kernel.clip_rect = m.Region(m.Origin(x0, y0, 0), m.Size(cw, ch, _HUGE))
        kernel.destination_feature_channel_offset = cfg.dco
        n, c, h, w = p_shape
        if cfg.destination_size is not None:
            w, h = cfg.destination_size
        dst = m.Image.from_tensor(torch.zeros(n, cfg.dco + c, h, w, dtype=dtype, device=device))
        xi, yi = m.Image.from_tensor(x), m.Image.from_tensor(y)
        cb = dev.new_command_queue().command_buffer()
        state = kernel.result_state(xi, yi)
        kernel.encode(cb, xi, yi, dst, state)
        grads: dict[str, Any] = {}
        if cotangent is not None:
            g = m.Image.from_tensor(cotangent(dst.shape).to(device=device, dtype=dtype))
            needs_other = self.name in ("multiply", "divide")
            for key, secondary in (("x", False), ("y", True)):
                other = (xi if secondary else yi) if needs_other else (yi if secondary else xi)
                gk = getattr(m, self.gradient)(dev, secondary)
                grads[key] = gk.encode(cb, g, other, state)
        _run_buffer(cb)
        grads = {k: _out(v.tensor) for k, v in grads.items()}
        offsets = (tuple(kernel.primary_offset), tuple(kernel.secondary_offset))
        geometry = Geometry(
            p_shape, tuple(dst.shape), offsets[0], kernel.primary_edge_mode,  # type: ignore[arg-type]
            cfg.clip is not None, 0, cfg.dco, c, c,
            params={"op": _OPS[self.name], "offsets": offsets, "natural_size": p_shape[2:]},
        )  # fmt: skip
        return Outcome(_out(dst.tensor), grads, geometry)


def _families() -> dict[str, Family]:
    conv = GEOMETRY | {"kernel", "stride", "dilation", "out_channels", "groups", "padding"}
    pool = GEOMETRY | {"kernel", "stride", "padding"}
    pool_defaults = {"kernel": (2, 2), "stride": (2, 2)}
    fams = [
        _Convolution("convolution", "Convolution", "ConvolutionGradient", conv),
        _FullyConnected(
            "fully-connected", "FullyConnected", "FullyConnectedGradient",
            frozenset({"kernel", "out_channels", "clip", "sco", "dco", "destination_size"}),
            {"kernel": None},  # the source size
        ),
        _Convolution(
            "convolution-transpose", "ConvolutionTranspose", "ConvolutionTransposeGradient", conv
        ),
        _Pooling("pooling-max", "PoolingMax", "PoolingMaxGradient", pool, pool_defaults),
        _Pooling(
            "pooling-average", "PoolingAverage", "PoolingAverageGradient", pool, pool_defaults,
            linear=True,
        ),
        _Pooling("pooling-l2", "PoolingL2Norm", "PoolingL2NormGradient", pool, pool_defaults),
        _Pooling(
            "dilated-pooling-max", "DilatedPoolingMax", "DilatedPoolingMaxGradient",
            pool | {"dilation"}, {"kernel": (3, 3), "stride": (1, 1), "dilation": (2, 2)},
        ),
        _Neuron("neuron", "Neuron", "NeuronGradient", GEOMETRY | {"neuron", "a", "b", "c"}),
        Family("softmax", "SoftMax", "SoftMaxGradient", linear=False, reads_result=True),
        Family("log-softmax", "LogSoftMax", "LogSoftMaxGradient", linear=False, reads_result=True),
        _Upsampling(
            "upsampling-nearest", "UpsamplingNearest", "UpsamplingNearestGradient",
            GEOMETRY | {"scale"},
        ),
        _Upsampling(
            "upsampling-bilinear", "UpsamplingBilinear", "UpsamplingBilinearGradient",
            GEOMETRY | {"scale", "align_corners"},
        ),
        _BatchNorm("batch-normalization", "BatchNormalization", "BatchNormalizationGradient"),
        _GroupNorm(
            "instance-normalization", "InstanceNormalization", "InstanceNormalizationGradient"
        ),
        _GroupNorm(
            "group-normalization", "GroupNormalization", "GroupNormalizationGradient",
            GEOMETRY | {"groups"}, {"groups": 2},
        ),
        _Dropout("dropout", "Dropout", "DropoutGradient", GEOMETRY | {"keep_probability"}),
        _Pad("pad", "Pad", "PadGradient", GEOMETRY | {"pad_before", "pad_after", "fill_value"}),
        Family("slice", "Slice", "SliceGradient"),
    ]  # fmt: skip
    for op in _OPS:
        cls = op.capitalize()
        fams.append(_Arithmetic(op, cls, f"{cls}Gradient"))
    return {f.name: f for f in fams}


FAMILIES = _families()


def make_config(family: Family, given: dict[str, Any]) -> Config:
    """The configuration of a check: the command line's values (``given``), then the family's
    defaults, then `Config`'s."""
    fills: dict[str, Any] = {**family.defaults, **given}
    if fills.get("kernel", ()) is None:  # fully connected: the kernel is the source size
        fills["kernel"] = tuple(fills["size"][:2])
    return Config(family=family.name, **fills)
