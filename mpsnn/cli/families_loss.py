"""The ``mpsnn check`` families of the split loss (`ForwardLoss`, `LossGradient`).

* ``forward-loss``: `ForwardLoss` alone, its loss image against a float64 restatement of the
  documented formulas (`mpsnn.cli.references_loss`). Forward only.
* ``loss-gradient``: `ForwardLoss`, then two `LossGradient` kernels reading its gradient state
  with a random incoming gradient of the loss image (the check's cotangent): the gradient with
  respect to the predictions and, with ``compute_label_gradients``, the labels (every loss type
  but Kullback-Leibler, which has none); against autograd of the restatement, plus the adjoint
  test of each.

Options: ``--loss`` (the loss type, softmax-cross-entropy), ``--reduction`` (mean),
``--reduce-across-batch``, ``--weight`` (the descriptor's weight, 1) and ``--loss-weights`` (a
weights image, some of it 0). The loss kernels read whole images, so no geometry option
applies. Inputs lie in each loss's domain: predictions in (0.05, 0.95) for the log loss and the
categorical cross entropy, log probabilities for Kullback-Leibler; labels in [0, 1) (0 or 1
for the hinge loss), of the predictions' shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mpsnn.cli.family import Config, Cotangent, Family, Outcome, Values, cpu64, m, run_buffer
from mpsnn.cli.references_geometry import Geometry
from mpsnn.cnn.loss import LossDescriptor, LossType, ReductionType
from mpsnn.cnn.loss_split import ForwardLoss, LossGradient

__all__ = ["LOSS_TYPES", "REDUCTIONS", "loss_families"]

LOSS_TYPES = {t.name.lower().replace("_", "-"): t for t in LossType}
REDUCTIONS = {t.name.lower().replace("_", "-"): t for t in ReductionType}


@dataclass
class _SplitLoss(Family):
    """The forward loss, and (with a gradient kernel) the prediction and label gradients."""

    options: frozenset[str] = frozenset(
        {"loss", "reduction", "reduce_across_batch", "weight", "loss_weights"}
    )
    linear: bool = False
    grad_names: tuple[str, ...] = ("x", "labels")

    def descriptor(self, cfg: Config) -> LossDescriptor:
        return LossDescriptor(LOSS_TYPES[cfg.loss], REDUCTIONS[cfg.reduction], weight=cfg.weight)

    def gradient_inputs(self, cfg: Config) -> tuple[str, ...]:
        if self.gradient is None:
            return ()
        if LOSS_TYPES[cfg.loss] is LossType.KULLBACK_LEIBLER_DIVERGENCE:
            return ("x",)  # d(t log t)/dt is infinite at t = 0: no label gradient
        return self.grad_names

    def inputs(self, cfg: Config, gen: torch.Generator) -> Values:
        kind, shape = LOSS_TYPES[cfg.loss], cfg.source_shape
        if kind in (LossType.LOG, LossType.CATEGORICAL_CROSS_ENTROPY):
            y = torch.rand(shape, generator=gen, dtype=torch.float64) * 0.9 + 0.05
        else:
            y = torch.randn(shape, generator=gen, dtype=torch.float64)
        if kind is LossType.KULLBACK_LEIBLER_DIVERGENCE:
            y = F.log_softmax(y, 1)
        t = torch.rand(shape, generator=gen, dtype=torch.float64)
        if kind is LossType.HINGE:
            t = (t > 0.5).double()
        values = {"x": y, "labels": t}
        if cfg.loss_weights:
            w = torch.rand(shape, generator=gen, dtype=torch.float64)
            values["weights"] = torch.where(w < 0.2, torch.zeros_like(w), w)
        return values

    def params(self, cfg: Config, fwd: Any) -> dict[str, Any]:
        return {
            "loss_type": fwd.loss_type.name, "reduction": fwd.reduction_type.name,
            "weight": fwd.weight, "label_smoothing": fwd.label_smoothing,
            "epsilon": fwd.epsilon, "delta": fwd.delta,
            "number_of_classes": fwd.number_of_classes,
            "reduce_across_batch": fwd.reduce_across_batch,
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
        desc, across = self.descriptor(cfg), cfg.reduce_across_batch
        fwd = ForwardLoss(dev, desc, reduce_across_batch=across)
        images = {
            k: m.Image.from_tensor(v.to(device=device, dtype=dtype)) for k, v in values.items()
        }
        x, labels, weights = images["x"], images["labels"], images.get("weights")
        cb = dev.new_command_queue().command_buffer()
        state = fwd.result_state(x)
        loss = fwd.encode(cb, x, labels, weights, state)
        grads: dict[str, Any] = {}
        names = self.gradient_inputs(cfg)
        if cotangent is not None and names:
            g = m.Image.from_tensor(cotangent(tuple(loss.shape)).to(device=device, dtype=dtype))
            for key in names:
                k = LossGradient(dev, desc, reduce_across_batch=across,
                                 compute_label_gradients=key == "labels")  # fmt: skip
                grads[key] = k.encode(cb, g, x, labels, weights, state)
        run_buffer(cb)
        c = tuple(x.shape)[1]
        geometry = Geometry(
            tuple(x.shape), tuple(loss.shape), (0, 0, 0), m.EdgeMode.ZERO,  # type: ignore[arg-type]
            False, 0, 0, c, tuple(loss.shape)[1], params=self.params(cfg, fwd),
        )  # fmt: skip
        return Outcome(cpu64(loss.tensor), {k: cpu64(v.tensor) for k, v in grads.items()}, geometry)

    def kernel_names(self, cfg: Config) -> tuple[str, str | None]:
        return "ForwardLoss", self.gradient


def loss_families() -> list[Family]:
    """The families of this module, in the order ``mpsnn check --help`` lists them."""
    return [
        _SplitLoss("forward-loss", "ForwardLoss", None, grad_names=()),
        _SplitLoss("loss-gradient", "ForwardLoss", "LossGradient"),
    ]
