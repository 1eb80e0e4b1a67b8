"""The ``mpsnn check`` families of the Gram matrix, the reductions, the local correlation and
the resizes (the comparison, an arithmetic kernel, is with the arithmetic families in
`mpsnn.cli.families`).

* ``gram``: `GramMatrixCalculation` and its gradient (``--alpha``).
* ``reduce``: one reduction kernel, chosen with ``--op`` (`REDUCE_OPS`): the fourteen unary
  ``Reduce*`` kernels and the three feature-channels-and-weights reductions (these read a
  second source, the weights: ``--secondary-size``, 1x1 by default). ``--source-clip`` sets the
  source region read (``clip_rect_source``, or both sources' clip rects). Forward only.
* ``local-correlation``: `LocalCorrelation` (``--window``, ``--stride``, ``--source-clip`` for
  both sources). Forward only.
* ``resize-bilinear``, ``crop-and-resize-bilinear``: the resizes and their gradients
  (``--resize``, ``--align-corners``, ``--region``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.cli.family import (
    GEOMETRY,
    HUGE,
    Config,
    Cotangent,
    Family,
    Outcome,
    Values,
    cpu64,
    m,
    randn64,
    run_buffer,
)
from mpsnn.cli.references_geometry import Geometry
from mpsnn.cnn.reduce import source_region

__all__ = ["REDUCE_OPS", "more_families"]


def _kebab(name: str) -> str:
    out = "".join("-" + ch.lower() if ch.isupper() else ch for ch in name)
    return out.lstrip("-")


# ``--op`` of the reduce family: the kernel class and its constructor's keyword arguments
REDUCE_OPS: dict[str, tuple[type, dict[str, Any]]] = {
    _kebab(name.removeprefix("Reduce")): (getattr(m, name), {})
    for name in (
        "ReduceRowMin", "ReduceRowMax", "ReduceRowMean", "ReduceRowSum", "ReduceColumnMin",
        "ReduceColumnMax", "ReduceColumnMean", "ReduceColumnSum", "ReduceFeatureChannelsMin",
        "ReduceFeatureChannelsMax", "ReduceFeatureChannelsMean", "ReduceFeatureChannelsSum",
        "ReduceFeatureChannelsArgumentMin", "ReduceFeatureChannelsArgumentMax",
        "ReduceFeatureChannelsAndWeightsMean", "ReduceFeatureChannelsAndWeightsSum",
    )
}  # fmt: skip
REDUCE_OPS["feature-channels-and-weights-sum-by-non-zero-weights"] = (
    m.ReduceFeatureChannelsAndWeightsSum,
    {"do_weighted_sum_by_non_zero_weights": True},
)


def _region(clip: tuple[int, int, int, int] | None) -> Any:
    if clip is None:
        return m.RECT_NO_CLIP
    x0, y0, w, h = clip
    return m.Region(m.Origin(x0, y0, 0), m.Size(w, h, HUGE))


def _secondary_shape(cfg: Config) -> tuple[int, int, int, int]:
    w, h, c = cfg.secondary_size or cfg.size
    return (cfg.batch, c, h, w)


def _binary_run(
    fam: Family,
    cfg: Config,
    kernel: Any,
    written: int,
    values: Values,
    device: str,
    dtype: torch.dtype,
) -> Outcome:
    """A forward-only two-source reduction (weights or local correlation) writing ``written``
    channels: each source read in ``--source-clip`` (the weights too unless they are 1x1),
    channels from ``--source-channel-offset``, written from ``--destination-channel-offset``."""
    dev = m.Device(device)
    x, y = (values[k].to(device=device, dtype=dtype) for k in ("x", "y"))
    region = _region(cfg.source_clip)
    kernel.primary_source_clip_rect = region
    if tuple(y.shape[2:]) != (1, 1):
        kernel.secondary_source_clip_rect = region
    kernel.primary_source_feature_channel_offset = cfg.sco
    kernel.secondary_source_feature_channel_offset = cfg.sco
    kernel.destination_feature_channel_offset = cfg.dco
    _, images, _, rows, _, cols = source_region(
        type(kernel).__name__, "--source-clip", region, tuple(x.shape), images=False
    )
    dst = m.Image.from_tensor(
        torch.zeros(images, cfg.dco + written, rows, cols, dtype=dtype, device=device)
    )
    cb = dev.new_command_queue().command_buffer()
    kernel.encode(cb, m.Image.from_tensor(x), m.Image.from_tensor(y), dst)
    run_buffer(cb)
    geometry = Geometry(
        tuple(x.shape), tuple(dst.shape), (0, 0, 0), m.EdgeMode.ZERO,  # type: ignore[arg-type]
        False, cfg.sco, cfg.dco, cfg.size[2] - cfg.sco, written,
        params={**fam.params(cfg, kernel), "source_clip": cfg.source_clip},
    )  # fmt: skip
    return Outcome(cpu64(dst.tensor), {}, geometry)


@dataclass
class _Gram(Family):
    linear: bool = False  # quadratic

    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        return m.GramMatrixCalculation(dev, cfg.alpha), m.GramMatrixCalculationGradient(
            dev, cfg.alpha
        )

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        return {"alpha": cfg.alpha}


@dataclass
class _Reduce(Family):
    """The unary reductions through `Family.run`; the weights reductions through
    `_binary_run`."""

    grad_names: tuple[str, ...] = ()

    def binary(self, cfg: Config) -> bool:
        return issubclass(REDUCE_OPS[cfg.op][0], m.ReduceBinary)

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        x = randn64(cfg.source_shape, gen)
        if not self.binary(cfg):
            return {"x": x}
        w, h, c = cfg.secondary_size or (1, 1, cfg.size[2])
        weights = randn64((cfg.batch, c, h, w), gen)
        # zero weights, for the division by the number of non-zero weights
        zero = torch.rand(weights.shape, generator=gen, dtype=torch.float64) < 0.3
        return {"x": x, "y": torch.where(zero, torch.zeros_like(weights), weights)}

    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        cls, kwargs = REDUCE_OPS[cfg.op]
        k = cls(dev, **kwargs)
        k.clip_rect_source = _region(cfg.source_clip)
        if cls is m.ReduceFeatureChannelsSum:
            k.weight = cfg.weight
        return k, None

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        return {"op": cfg.op, "weight": cfg.weight, "source_clip": cfg.source_clip}

    def run(
        self,
        cfg: Config,
        values: Values,
        device: str,
        dtype: torch.dtype,
        cotangent: Cotangent | None = None,
    ) -> Outcome:
        if not self.binary(cfg):
            return super().run(cfg, values, device, dtype, cotangent)
        cls, kwargs = REDUCE_OPS[cfg.op]
        kernel = cls(m.Device(device), **kwargs)
        return _binary_run(self, cfg, kernel, 1, values, device, dtype)

    def kernel_names(self, cfg: Config) -> tuple[str, str | None]:
        return REDUCE_OPS[cfg.op][0].__name__, None


@dataclass
class _LocalCorrelation(Family):
    grad_names: tuple[str, ...] = ()

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        return {"x": randn64(cfg.source_shape, gen), "y": randn64(_secondary_shape(cfg), gen)}

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        return {"window": cfg.window, "stride": cfg.stride}

    def run(
        self,
        cfg: Config,
        values: Values,
        device: str,
        dtype: torch.dtype,
        cotangent: Cotangent | None = None,
    ) -> Outcome:
        kernel = m.LocalCorrelation(m.Device(device), *cfg.window, *cfg.stride)
        (wx, wy) = cfg.window
        written = (2 * wx + 1) * (2 * wy + 1)
        return _binary_run(self, cfg, kernel, written, values, device, dtype)


@dataclass
class _Resize(Family):
    def kernels(self, cfg: Config, dev: m.Device, p: Values) -> tuple[Any, Any]:
        w, h = cfg.resize
        if self.name == "resize-bilinear":
            args: tuple[Any, ...] = (w, h, cfg.align_corners)
        else:
            args = (w, h, len(cfg.regions), cfg.regions)
        return getattr(m, self.forward)(dev, *args), getattr(m, self.gradient)(dev, *args)

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        return {"resize": cfg.resize, "align_corners": cfg.align_corners, "regions": cfg.regions}


def more_families() -> list[Family]:
    """The families of this module, in the order ``mpsnn check --help`` lists them."""
    fwd_geometry = frozenset({"sco", "dco"})
    return [
        _Gram(
            "gram", "GramMatrixCalculation", "GramMatrixCalculationGradient",
            frozenset({"alpha", "sco", "dco"}), {"alpha": 0.25},
        ),
        _Reduce(
            "reduce", "Reduce", None,
            fwd_geometry | {"op", "weight", "source_clip", "secondary_size"},
        ),
        _LocalCorrelation(
            "local-correlation", "LocalCorrelation", None,
            fwd_geometry | {"window", "stride", "source_clip", "secondary_size"},
            {"window": (2, 1), "stride": (1, 2)},
        ),
        _Resize(
            "resize-bilinear", "ResizeBilinear", "ResizeBilinearGradient",
            GEOMETRY | {"resize", "align_corners"},
        ),
        _Resize(
            "crop-and-resize-bilinear", "CropAndResizeBilinear", "CropAndResizeBilinearGradient",
            frozenset({"clip", "sco", "dco", "destination_size", "resize", "regions"}),
            {"resize": (4, 3)},
        ),
    ]  # fmt: skip
