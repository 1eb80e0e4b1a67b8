"""The ``mpsnn check`` family of the YOLO loss (`YOLOLoss`).

* ``yolo-loss``: `YOLOLoss` with MPS's usual sub-losses (XY mean squared error, WH Huber,
  confidence sigmoid cross entropy, classes softmax cross entropy) and MPS's default scales and
  thresholds: its loss image (the labels' ``loss_image``) against a float64 restatement of the
  documented rules (`mpsnn.cli.references_yolo`), and its gradient (the destination) against
  autograd of the restatement, plus the adjoint test.

Options: ``--anchors`` (``WxH`` anchor boxes in grid cells, comma-separated; 1x2,1x1,2x1),
``--classes`` (2), ``--rescore/--no-rescore`` (on), ``--reduction`` (mean) and
``--loss-weights`` (a weights image of the labels' shape, some of it 0). ``--size``'s width and
height are the grid's; its channels, when given, must be ``A·(5+K)`` (A anchors, K classes),
the predictions' channels. The loss reads whole images, so no geometry option applies.

Inputs: predictions ``1.5·N(0, 1)``; labels as `mpsnn.ops.yolo.boxes_to_labels` writes them:
a box (centre inside the cell, size 0.3 to 3.5 cells, a random class) in about 60% of the
cells, written into every anchor slot of its cell (the loss picks the responsible ones; the
others are object, no-object or ignored slots by their shape IoU), empty slots 0 with class
channels 1/K.

The kernel computes the gradient of the sum of each image's loss; the check's cotangent is one
value per image, which scales that image's gradient (`Family.per_image_cotangent`). With
``rescore`` the confidence target holds the IoU of the predicted box, which the gradient holds
constant (YOLOv2): the gradient is then not the derivative of the forward and has no adjoint
test (the autograd reference holds the IoU constant too, so that check stands).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.cli.families_loss import REDUCTIONS
from mpsnn.cli.family import Config, Cotangent, Family, Outcome, Values, cpu64, m, run_buffer
from mpsnn.cli.references_geometry import Geometry
from mpsnn.cnn.loss import LossType
from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.cnn.yolo import YOLOLoss, YOLOLossDescriptor

__all__ = ["yolo_families"]

_SUBS = ("xy", "wh", "confidence", "classes_loss")


def _labels(cfg: Config, gen: torch.Generator) -> torch.Tensor:
    """Labels (N, A·(5+K), H, W) in the usual layout (see the module docstring)."""
    w, h, _ = cfg.size
    a, k = len(cfg.anchors), cfg.classes
    out = torch.zeros(cfg.batch, a, 5 + k, h, w, dtype=torch.float64)
    out[:, :, 5:] = 1.0 / k
    for b in range(cfg.batch):
        for i in range(h):
            for j in range(w):
                if torch.rand(1, generator=gen).item() > 0.6:
                    continue
                box = torch.zeros(5 + k, dtype=torch.float64)
                box[0:2] = torch.rand(2, generator=gen, dtype=torch.float64)
                box[2:4] = 0.3 + 3.2 * torch.rand(2, generator=gen, dtype=torch.float64)
                box[4] = 1.0
                box[5 + int(torch.randint(k, (1,), generator=gen))] = 1.0
                out[b, :, :, i, j] = box
    return out.reshape(cfg.batch, a * (5 + k), h, w)


@dataclass
class _YOLOLoss(Family):
    options: frozenset[str] = frozenset(
        {"anchors", "classes", "rescore", "reduction", "loss_weights"}
    )
    linear: bool = False
    per_image_cotangent: bool = True

    def complete(self, values: dict[str, Any], given: set[str]) -> dict[str, Any]:
        anchors = values.get("anchors", Config.anchors)
        k = values.get("classes", Config.classes)
        channels = len(anchors) * (5 + k)
        w, h, c = values["size"]
        if "size" in given and c != channels:
            raise ValueError(
                f"--size must have the predictions' {len(anchors)}·(5 + {k}) = {channels} "
                f"channels (--anchors, --classes) for {self.name}, got {c}"
            )
        return {**values, "size": (w, h, channels)}

    def no_adjoint(self, cfg: Config) -> str | None:
        if not cfg.rescore:
            return None
        return (
            "rescore: the gradient holds the IoU in the confidence target constant (YOLOv2), "
            "so it is not the derivative of the forward; --no-rescore has an adjoint test"
        )

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        values = {"x": torch.randn(cfg.source_shape, generator=gen, dtype=torch.float64) * 1.5}
        values["labels"] = _labels(cfg, gen)
        if cfg.loss_weights:
            wt = torch.rand(cfg.source_shape, generator=gen, dtype=torch.float64)
            values["weights"] = torch.where(wt < 0.2, torch.zeros_like(wt), wt)
        return values

    def descriptor(self, cfg: Config) -> YOLOLossDescriptor:
        return YOLOLossDescriptor(
            LossType.MEAN_SQUARED_ERROR, LossType.HUBER, LossType.SIGMOID_CROSS_ENTROPY,
            LossType.SOFTMAX_CROSS_ENTROPY, REDUCTIONS[cfg.reduction], cfg.anchors,
            rescore=cfg.rescore,
        )  # fmt: skip

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        subs = (fwd.loss_xy, fwd.loss_wh, fwd.loss_confidence, fwd.loss_classes)
        return {
            "anchors": [list(a) for a in fwd.anchor_boxes], "classes": cfg.classes,
            "rescore": fwd.rescore, "reduction": fwd.reduction_type.name,
            "scales": [fwd.scale_xy, fwd.scale_wh, fwd.scale_no_object, fwd.scale_object,
                       fwd.scale_class],
            "min_iou": fwd.min_iou_for_object_presence,
            "max_iou": fwd.max_iou_for_object_absence,
            **{name: {"loss_type": s.loss_type.name, "weight": s.weight,
                      "label_smoothing": s.label_smoothing, "delta": s.delta}
               for name, s in zip(_SUBS, subs, strict=True)},
        }  # fmt: skip

    def run(
        self,
        cfg: Config,
        values: Values,
        device: str,
        dtype: torch.dtype,
        cotangent: Cotangent | None = None,
    ) -> Outcome:
        dev = m.Device(device)
        kernel = YOLOLoss(dev, self.descriptor(cfg))
        x = m.Image.from_tensor(values["x"].to(device=device, dtype=dtype))
        weights = values.get("weights")
        labels = LossLabels(
            dev, values["labels"].to(device=device, dtype=dtype),
            None if weights is None else weights.to(device=device, dtype=dtype),
        )  # fmt: skip
        cb = dev.new_command_queue().command_buffer()
        grad = kernel.encode(cb, x, labels)
        run_buffer(cb)
        loss = labels.loss_image()
        n, c = tuple(x.shape)[:2]
        grads = {}
        if cotangent is not None:  # the gradient of sum_n cot[n] · (image n's loss, summed)
            grads["x"] = cpu64(grad.tensor) * cotangent((n, 1, 1, 1))
        geometry = Geometry(
            tuple(x.shape), tuple(loss.shape), (0, 0, 0), m.EdgeMode.ZERO,  # type: ignore[arg-type]
            False, 0, 0, c, tuple(loss.shape)[1], params=self.params(cfg, kernel),
        )  # fmt: skip
        return Outcome(cpu64(loss.tensor), grads, geometry)

    def kernel_names(self, cfg: Config) -> tuple[str, str | None]:
        return "YOLOLoss", "YOLOLoss (its destination)"


def yolo_families() -> list[Family]:
    """The families of this module, in the order ``mpsnn check --help`` lists them."""
    return [_YOLOLoss("yolo-loss", "YOLOLoss", "YOLOLoss")]
