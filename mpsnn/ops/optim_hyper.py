"""The vocabulary of the optimizer updates (`mpsnn.ops.optim`): the update rules and their
state vectors, the regularization types, and the device tensors that hold the
hyperparameters and Adam's step. Their one home is here; `mpsnn.ops.optim` applies the updates.

Hyperparameters live in device memory, so that a captured CUDA graph follows changes made
between replays and Adam's step advances on the device. The hyperparameter tensor
(`make_hyper`, `set_hyper`) is float64 of shape ``(HYPER_SIZE,)``, laid out as `Hyper`:

    ===  ================================================================
    0    learning_rate
    1    gradient_rescale
    2    gradient_clip_min  (read only with clip=True)
    3    gradient_clip_max  (read only with clip=True)
    4    regularization_scale  (read only with L1 or L2)
    5    momentum_scale (SGD) = decay (RMSProp) = beta1 (Adam)
    6    beta2 (Adam)
    7    epsilon (RMSProp, Adam)
    ===  ================================================================

Adam's step tensor (`make_step`) is int64 of shape ``(2,)``: ``[t, 0]`` with ``t`` the number of
updates done; the second entry is the Triton kernel's arrival counter and is 0 between updates.
What the options select (the rule, ``clip``, the regularization type) stays on the host: MPS
fixes them when it makes an optimizer; changing them needs a new capture.
"""

from __future__ import annotations

import enum
import math

import torch

from mpsnn.core.layout import channels_last_only

__all__ = [
    "HYPER_SIZE",
    "Hyper",
    "RegularizationType",
    "UpdateRule",
    "init_state",
    "make_hyper",
    "make_step",
    "set_hyper",
    "set_step",
]


class RegularizationType(enum.IntEnum):
    """MPSNNRegularizationType."""

    NONE = 0
    L1 = 1
    L2 = 2


class UpdateRule(enum.IntEnum):
    """The update rules; ``state_names`` lists each rule's state vectors in order."""

    SGD = 0
    SGD_MOMENTUM = 1
    SGD_NESTEROV = 2
    RMSPROP = 3
    ADAM = 4
    ADAM_AMSGRAD = 5

    @property
    def state_names(self) -> tuple[str, ...]:
        return _STATE_NAMES[self]


_STATE_NAMES = {
    UpdateRule.SGD: (),
    UpdateRule.SGD_MOMENTUM: ("momentum",),
    UpdateRule.SGD_NESTEROV: ("momentum",),
    UpdateRule.RMSPROP: ("sum_of_squares",),
    UpdateRule.ADAM: ("momentum", "velocity"),
    UpdateRule.ADAM_AMSGRAD: ("momentum", "velocity", "max_velocity"),
}
_ADAM_RULES = (UpdateRule.ADAM, UpdateRule.ADAM_AMSGRAD)


class Hyper(enum.IntEnum):
    """Index of each hyperparameter in the hyperparameter tensor (aliases share slot 5)."""

    LEARNING_RATE = 0
    GRADIENT_RESCALE = 1
    GRADIENT_CLIP_MIN = 2
    GRADIENT_CLIP_MAX = 3
    REGULARIZATION_SCALE = 4
    MOMENTUM_SCALE = 5
    DECAY = 5
    BETA1 = 5
    BETA2 = 6
    EPSILON = 7


HYPER_SIZE = 8
_FIELDS = {name.lower(): int(slot) for name, slot in Hyper.__members__.items()}


# ---------------------------------------------------------------------------------------------
# hyperparameters, step, state


def make_hyper(
    device: torch.device | str,
    *,
    learning_rate: float,
    gradient_rescale: float = 1.0,
    gradient_clip_min: float = -math.inf,
    gradient_clip_max: float = math.inf,
    regularization_scale: float = 0.0,
    momentum_scale: float | None = None,
    decay: float | None = None,
    beta1: float | None = None,
    beta2: float = 0.0,
    epsilon: float = 0.0,
) -> torch.Tensor:
    """A float64 hyperparameter tensor on ``device`` (layout: `Hyper`). ``momentum_scale``,
    ``decay`` and ``beta1`` name the same slot: give at most one (default 0). The defaults
    are neutral, not MPS's per-optimizer defaults (the optimizer classes supply those)."""
    slot5 = [x for x in (momentum_scale, decay, beta1) if x is not None]
    if len(slot5) > 1:
        raise ValueError("[make_hyper] momentum_scale, decay and beta1 share a slot: give one")
    _check_learning_rate("make_hyper", learning_rate)
    values = [learning_rate, gradient_rescale, gradient_clip_min, gradient_clip_max,
              regularization_scale, slot5[0] if slot5 else 0.0, beta2, epsilon]  # fmt: skip
    return torch.tensor([float(x) for x in values], dtype=torch.float64, device=device)


def set_hyper(hyper: torch.Tensor, **fields: float) -> None:
    """Write hyperparameters in place (field names as in `make_hyper`), on the current stream
    and without waiting; updates encoded or replayed after it read the new values."""
    _check_hyper(hyper)
    for name, value in fields.items():
        slot = _FIELDS.get(name)
        if slot is None:
            raise ValueError(f"[set_hyper] unknown hyperparameter {name!r}; one of {list(_FIELDS)}")
        if slot == Hyper.LEARNING_RATE:
            _check_learning_rate("set_hyper", value)
        hyper[slot].fill_(float(value))  # a fill kernel: no host-to-device copy, no wait


def make_step(device: torch.device | str, t: int = 0) -> torch.Tensor:
    """Adam's step tensor ``[t, 0]`` (int64): ``t`` updates done."""
    return torch.tensor([int(t), 0], dtype=torch.int64, device=device)


def set_step(step: torch.Tensor, t: int) -> None:
    """Set the number of updates done (the next update uses ``t + 1``)."""
    _check_step(step)
    step[0].fill_(int(t))


def init_state(rule: UpdateRule, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Zero state vectors of one parameter for ``rule`` (``rule.state_names``), in ``value``'s
    dtype and device: channels-last for channels-last 4-D weights (the CPU's float32
    convolution masters, a contiguous OHWI tensor given as weights: the element-wise update then
    reads them in one order), else contiguous. `mpsnn.ops.optim.apply_update` takes them as
    one list per state vector."""
    rule = UpdateRule(rule)
    layout = torch.channels_last if channels_last_only(value) else torch.contiguous_format
    return tuple(torch.zeros_like(value, memory_format=layout) for _ in rule.state_names)


# ---------------------------------------------------------------------------------------------
# checks


def _check_hyper(hyper: torch.Tensor) -> None:
    if hyper.dtype != torch.float64 or tuple(hyper.shape) != (HYPER_SIZE,):
        raise ValueError(
            f"hyperparameters must be a float64 tensor of shape ({HYPER_SIZE},) (make_hyper), "
            f"got {hyper.dtype} {tuple(hyper.shape)}"
        )


def _check_step(step: torch.Tensor) -> None:
    if step.dtype != torch.int64 or tuple(step.shape) != (2,) or not step.is_contiguous():
        raise ValueError(
            f"the step must be a contiguous int64 tensor of shape (2,) (make_step), got "
            f"{step.dtype} {tuple(step.shape)}"
        )


def _check_learning_rate(who: str, lr: float) -> None:
    if not math.isfinite(lr):
        raise ValueError(f"[{who}] the learning rate must be finite, got {lr}")
