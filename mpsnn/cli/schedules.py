"""The learning-rate schedule of ``mpsnn train`` and its optimizer and loss options: what each
option means, the checks that refuse a bad value before any training work, and the MPS
descriptors they set.

The rate of step ``s`` (0-based) of epoch ``e`` (1-based), with ``S`` steps per epoch, ``E``
epochs, ``g = (e - 1)·S + s`` steps done before it, base rate ``lr`` and decay ``d``::

    constant     lr
    exponential  lr · d^(e-1)                      (per epoch)
    step         lr · d^floor((e-1) / k)           (per epoch; k = --step-epochs)
    cosine       lr · (1 + cos(π·p)) / 2,  p = (g - Wₛ) / (E·S - Wₛ)   (per step, to 0)

times the warmup factor ``min(1, (g + 1) / Wₛ)`` during the first ``Wₛ = round(W·S)`` steps
(``W`` = --warmup-epochs, at least one step when ``W > 0``): a linear ramp from ``lr/Wₛ`` to
the schedule's rate. The cosine runs over the steps after the warmup; exponential and step
count their epochs from the start of the run. With neither cosine nor a warmup, the rate
changes only between epochs.

Options of the update and the loss (MPS's descriptors):

* ``--momentum μ``: SGD's ``momentum_scale`` (default 0.9); Adam and RMSProp have no momentum
  in MPS (Adam's β1 stays 0.9), so it is refused with them.
* ``--weight-decay λ``: L2 regularization of the optimizer descriptor
  (``regularization_type = L2``, ``regularization_scale = λ``: the gradient gains ``λ·w``
  before the rule), as ``weight_decay`` of torch.optim.SGD/Adam/RMSprop.
* ``--clip-grad c``: the descriptor's gradient clipping, every gradient value clamped to
  ``[-c, c]`` (``apply_gradient_clipping``), as ``torch.nn.utils.clip_grad_value_``.
* ``--label-smoothing ε``: the loss descriptor's ``label_smoothing`` (targets
  ``(1 - ε)·t + ε/K``), as ``F.cross_entropy(label_smoothing=ε)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping
from typing import Any

from mpsnn.cli.common import OPTIMIZERS, SGD_MOMENTUM, UserError

__all__ = [
    "ADDED_OPTIONS",
    "SCHEDULES",
    "Schedule",
    "check_training_options",
    "describe_training",
    "loss_descriptor",
]

SCHEDULES = ("constant", "step", "exponential", "cosine")

#: the training options added after the first checkpoints were written, with the values the
#: runs of those checkpoints used (a checkpoint without them resumes with these)
ADDED_OPTIONS: dict[str, Any] = {
    "schedule": "exponential",
    "step_epochs": 2,
    "warmup_epochs": 0.0,
    "momentum": None,
    "weight_decay": 0.0,
    "clip_grad": None,
    "label_smoothing": 0.0,
}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The learning rate of every step of a run (the formulas in the module docstring).

    Attributes:
        lr: the base rate (the optimizer's default already resolved).
        kind: one of `SCHEDULES`.
        decay: ``d`` of exponential and step.
        step_epochs: ``k`` of step.
        warmup_epochs: ``W``.
        epochs: ``E``, the run's length.
        steps: ``S``, the steps per epoch.
    """

    lr: float
    kind: str = "exponential"
    decay: float = 0.6
    step_epochs: int = 2
    warmup_epochs: float = 0.0
    epochs: int = 1
    steps: int = 1

    @classmethod
    def of(cls, config: Any, steps: int) -> Schedule:
        """The schedule of a `TrainConfig` (or any object with its attributes) whose epochs
        have ``steps`` steps."""
        lr = OPTIMIZERS[config.optimizer] if config.lr is None else config.lr
        return cls(lr, config.schedule, config.lr_decay, config.step_epochs,
                   config.warmup_epochs, config.epochs, max(1, steps))  # fmt: skip

    @property
    def warmup_steps(self) -> int:
        """``Wₛ``: at least one step when there is a warmup, and not the whole run."""
        if self.warmup_epochs <= 0:
            return 0
        return min(max(1, round(self.warmup_epochs * self.steps)), self.epochs * self.steps - 1)

    @property
    def per_step(self) -> bool:
        """Whether the rate changes within an epoch (cosine or a warmup)."""
        return self.kind == "cosine" or self.warmup_steps > 0

    def base(self, epoch: int, step: int = 0) -> float:
        """The schedule's rate before the warmup factor."""
        if self.kind == "constant":
            return self.lr
        if self.kind == "exponential":
            return self.lr * self.decay ** (epoch - 1)
        if self.kind == "step":
            return self.lr * self.decay ** ((epoch - 1) // self.step_epochs)
        warm = self.warmup_steps
        done = (epoch - 1) * self.steps + step
        p = min(1.0, max(0.0, (done - warm) / (self.epochs * self.steps - warm)))
        return self.lr * (1 + math.cos(math.pi * p)) / 2

    def rate(self, epoch: int, step: int = 0) -> float:
        """The rate of step ``step`` (0-based) of epoch ``epoch`` (1-based)."""
        rate = self.base(epoch, step)
        warm = self.warmup_steps
        done = (epoch - 1) * self.steps + step
        if done < warm:
            rate *= (done + 1) / warm
        return rate

    def describe(self) -> str:
        """One phrase, e.g. ``exponential (x0.6/epoch), warmup 1 epoch``."""
        text = {
            "constant": "constant",
            "exponential": f"exponential (x{self.decay:g}/epoch)",
            "step": f"step (x{self.decay:g} every {self.step_epochs} epochs)",
            "cosine": "cosine to 0",
        }[self.kind]
        if self.warmup_epochs > 0:
            unit = "epoch" if self.warmup_epochs == 1 else "epochs"
            text += f", warmup {self.warmup_epochs:g} {unit}"
        return text


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def check_training_options(opts: Mapping[str, Any], given: Collection[str] = ()) -> None:
    """The schedule, update and loss options of a run (a command line's values or a
    `TrainConfig` as a dict), each a `UserError` naming what must hold. ``given``: the options
    on the command line; one that the chosen schedule or optimizer does not use is refused
    (it would be silently ignored). ``lr`` and ``lr_decay`` themselves are
    `mpsnn.cli.runs.check_schedule`'s."""
    o = {**ADDED_OPTIONS, **opts}
    kind = o["schedule"]
    if kind not in SCHEDULES:
        raise UserError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}")
    if type(o["step_epochs"]) is not int or o["step_epochs"] < 1:
        raise UserError(f"--step-epochs must be an int >= 1, got {o['step_epochs']!r}")
    if "lr_decay" in given and kind in ("constant", "cosine"):
        raise UserError(
            f"--lr-decay is the factor of the exponential and step schedules, got it with "
            f"--schedule {kind} (drop it, or choose one of those)"
        )
    if "step_epochs" in given and kind != "step":
        raise UserError(
            f"--step-epochs is the period of --schedule step, got it with --schedule {kind}"
        )
    warm, epochs = o["warmup_epochs"], o["epochs"]
    if not (_finite(warm) and 0 <= warm < epochs):
        raise UserError(
            f"--warmup-epochs must be a finite number >= 0 and less than the run's {epochs} "
            f"epochs, got {warm}"
        )
    momentum = o["momentum"]
    if momentum is not None:
        if not (_finite(momentum) and 0 <= momentum < 1):
            raise UserError(f"--momentum must be a number in [0, 1), got {momentum}")
        if o["optimizer"] != "sgd":
            raise UserError(
                f"--momentum is SGD's momentum (MPS's momentum_scale): --optimizer "
                f"{o['optimizer']} has none in MPS (Adam's beta1 stays 0.9), got --momentum "
                f"{momentum:g} with it; drop it or use --optimizer sgd"
            )
    decay = o["weight_decay"]
    if not (_finite(decay) and decay >= 0):
        raise UserError(f"--weight-decay must be a finite number >= 0, got {decay}")
    clip = o["clip_grad"]
    if clip is not None and not (_finite(clip) and clip > 0):
        raise UserError(f"--clip-grad must be a finite number > 0, got {clip}")
    smoothing = o["label_smoothing"]
    if not (_finite(smoothing) and 0 <= smoothing < 1):
        raise UserError(f"--label-smoothing must be a number in [0, 1), got {smoothing}")


def sgd_momentum(momentum: float | None) -> float:
    """SGD's momentum of a run (``None``: the default)."""
    return SGD_MOMENTUM if momentum is None else momentum


def optimizer_options(config: Any) -> dict[str, Any]:
    """The keyword arguments of `mpsnn.cli.common.make_optimizer` for a run's update
    options."""
    return {"momentum": config.momentum, "weight_decay": config.weight_decay,
            "clip_grad": config.clip_grad}  # fmt: skip


def loss_descriptor(batch_size: int, label_smoothing: float, classes: int) -> Any:
    """The training loss: softmax cross-entropy summed with weight ``1 / batch_size`` (the
    batch mean, as the models' default), with the label smoothing; None (the model's default
    loss) without smoothing."""
    from mpsnn.cnn.loss import LossDescriptor, LossType, ReductionType

    if not label_smoothing:
        return None
    return LossDescriptor(LossType.SOFTMAX_CROSS_ENTROPY, ReductionType.SUM,
                          weight=1.0 / batch_size, label_smoothing=label_smoothing,
                          number_of_classes=classes)  # fmt: skip


def describe_training(config: Any, schedule: Schedule) -> str:
    """The optimizer, its schedule and options in one line (the header of ``mpsnn train``)."""
    parts = [f"{config.optimizer} lr {schedule.lr:g} {schedule.describe()}"]
    if config.optimizer == "sgd":
        parts.append(f"momentum {sgd_momentum(config.momentum):g}")
    if config.weight_decay:
        parts.append(f"weight decay {config.weight_decay:g}")
    if config.clip_grad is not None:
        parts.append(f"gradient clip {config.clip_grad:g}")
    if config.label_smoothing:
        parts.append(f"label smoothing {config.label_smoothing:g}")
    return "; ".join(parts)
