"""How ``mpsnn check`` drives each kernel family: its inputs, one forward + gradient run, and
what the run resolved (`Geometry`, for the PyTorch references in `mpsnn.cli.references`); the
table of families, `FAMILIES` (the newer families are in `mpsnn.cli.families_more`,
`mpsnn.cli.families_loss` and `mpsnn.cli.families_yolo`, the pieces they are built from in
`mpsnn.cli.family`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.cli.families_loss import loss_families
from mpsnn.cli.families_more import more_families
from mpsnn.cli.families_yolo import yolo_families
from mpsnn.cli.family import (
    GEOMETRY,
    HUGE,
    Config,
    Cotangent,
    Family,
    Outcome,
    Values,
    as_param,
    cpu64,
    m,
    randn64,
    run_buffer,
)
from mpsnn.cli.references_geometry import Geometry

__all__ = [
    "COMPARISONS",
    "FAMILIES",
    "NEURON_TYPES",
    "make_config",
]


@dataclass
class _Convolution(Family):
    grad_names: tuple[str, ...] = ("x", "weights", "bias")

    def descriptor(self, cfg: Config) -> m.ConvolutionDescriptor:
        (kw, kh), (sx, sy), (dx, dy) = cfg.kernel, cfg.stride, cfg.dilation
        cin = self.channels_read(cfg)
        return m.ConvolutionDescriptor(kw, kh, cin, cfg.out_channels, sx, sy, dx, dy, cfg.groups)

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        x = randn64(cfg.source_shape, gen)
        o, kh, kw, ig = self.descriptor(cfg).weights_shape
        scale = (kh * kw * ig) ** -0.5
        return {
            "x": x,
            "weights": randn64((o, kh, kw, ig), gen) * scale,
            "bias": randn64((o,), gen),
        }

    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        ds = m.TensorConvolutionDataSource(self.descriptor(cfg), p["weights"], p["bias"])
        return getattr(m, self.forward)(dev, ds), getattr(m, self.gradient)(dev, ds)

    def state_grads(self, state: Any) -> dict[str, torch.Tensor]:
        return {
            "weights": cpu64(state.gradient_for_weights),
            "bias": cpu64(state.gradient_for_biases),
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
        x = randn64(cfg.source_shape, gen)
        values = {"x": x}
        if cfg.neuron == "prelu":
            slopes = randn64((self.channels_read(cfg),), gen) * 0.5
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
            "x": randn64(cfg.source_shape, gen) * 2 + 0.5,
            "gamma": torch.rand(c, generator=gen, dtype=torch.float64) + 0.5,
            "beta": randn64((c,), gen),
        }

    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        c = self.channels_read(cfg)
        if self.name == "instance-normalization":
            ds = m.TensorInstanceNormalizationDataSource(c, p["gamma"], p["beta"], epsilon=1e-5)
            return m.InstanceNormalization(dev, ds), m.InstanceNormalizationGradient(dev)
        ds = m.TensorGroupNormalizationDataSource(c, cfg.groups, p["gamma"], p["beta"], 1e-5)
        return m.GroupNormalization(dev, ds), m.GroupNormalizationGradient(dev)

    def state_grads(self, state: Any) -> dict[str, torch.Tensor]:
        return {"gamma": cpu64(state.gradient_for_gamma), "beta": cpu64(state.gradient_for_beta)}

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
        gamma, beta = as_param(values["gamma"], dtype), as_param(values["beta"], dtype)
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
        run_buffer(cb)
        grads = {}
        if dx is not None:
            grads = {
                "x": cpu64(dx.tensor),
                "gamma": cpu64(state.gradient_for_gamma),
                "beta": cpu64(state.gradient_for_beta),
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
        return Outcome(cpu64(y.tensor), grads, geometry)


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
        x = randn64(cfg.source_shape, gen)
        y = randn64(self.secondary_shape(cfg), gen)
        if self.name == "divide":  # keep the divisor away from 0
            y = torch.where(y < 0, y - 0.5, y + 0.5)
        return {"x": x, "y": y}

    def is_linear(self, cfg: Config, key: str) -> bool:
        return not (self.name == "divide" and key == "y")

    def make_kernel(self, cfg: Config, dev: m.Device) -> Any:
        return getattr(m, self.forward)(dev)

    def own_params(self, cfg: Config) -> dict[str, Any]:
        return {"op": _OPS[self.name]}

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
        kernel = self.make_kernel(cfg, dev)
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
            kernel.clip_rect = m.Region(m.Origin(x0, y0, 0), m.Size(cw, ch, HUGE))
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
        if cotangent is not None and self.gradient is not None:
            g = m.Image.from_tensor(cotangent(dst.shape).to(device=device, dtype=dtype))
            needs_other = self.name in ("multiply", "divide")
            for key, secondary in (("x", False), ("y", True)):
                other = (xi if secondary else yi) if needs_other else (yi if secondary else xi)
                gk = getattr(m, self.gradient)(dev, secondary)
                grads[key] = gk.encode(cb, g, other, state)
        run_buffer(cb)
        grads = {k: cpu64(v.tensor) for k, v in grads.items()}
        offsets = (tuple(kernel.primary_offset), tuple(kernel.secondary_offset))
        geometry = Geometry(
            p_shape, tuple(dst.shape), offsets[0], kernel.primary_edge_mode,  # type: ignore[arg-type]
            cfg.clip is not None, 0, cfg.dco, c, c,
            params={**self.own_params(cfg), "offsets": offsets, "natural_size": p_shape[2:]},
        )  # fmt: skip
        return Outcome(cpu64(dst.tensor), grads, geometry)


COMPARISONS = {t.name.lower().replace("_", "-"): t for t in m.ComparisonType}


@dataclass
class _Compare(_Arithmetic):
    """`Compare`, forward only (MPS defines no gradient); its inputs lie on a half-integer grid,
    so that values meet equal ones (and ones within ``--threshold``) in every dtype."""

    options: frozenset[str] = _Arithmetic.options | {"comparison", "threshold"}
    grad_names: tuple[str, ...] = ()

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        x = torch.randint(-3, 4, cfg.source_shape, generator=gen).double() / 2
        y = torch.randint(-3, 4, self.secondary_shape(cfg), generator=gen).double() / 2
        return {"x": x, "y": y}

    def make_kernel(self, cfg: Config, dev: m.Device) -> Any:
        k = m.Compare(dev)
        k.comparison_type = COMPARISONS[cfg.comparison]
        k.threshold = cfg.threshold
        return k

    def own_params(self, cfg: Config) -> dict[str, Any]:
        return {"comparison": COMPARISONS[cfg.comparison].name, "threshold": cfg.threshold}


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
    fams.append(_Compare("compare", "Compare", None))
    fams += more_families()
    fams += loss_families()
    fams += yolo_families()
    return {f.name: f for f in fams}


FAMILIES = _families()


def make_config(family: Family, given: dict[str, Any]) -> Config:
    """The configuration of a check: the command line's values (``given``), then the family's
    defaults, then `Config`'s."""
    fills: dict[str, Any] = {**family.defaults, **given}
    if fills.get("kernel", ()) is None:  # fully connected: the kernel is the source size
        fills["kernel"] = tuple(fills["size"][:2])
    return Config(family=family.name, **fills)
