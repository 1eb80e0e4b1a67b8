"""What the commands share: the user-error exception, device and dtype parsing, the model
registry and the optimizers."""

from __future__ import annotations

from typing import Any

import click
import torch

from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.core.device import Device

__all__ = [
    "DTYPES",
    "MODELS",
    "OPTIMIZERS",
    "OneLineCommand",
    "OneLineError",
    "SEED_MAX",
    "SGD_MOMENTUM",
    "UserError",
    "build_model",
    "make_optimizer",
    "parse_device",
    "tune_cpu_allocator",
]


class UserError(click.ClickException):
    """A user mistake: one line on stderr (``Error: ...``) and exit status 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo("Error: " + " ".join(self.format_message().split()), err=True)


class OneLineError(click.UsageError):
    """A usage error shown as one line on stderr (exit status 2), without the usage text."""

    def show(self, file: Any = None) -> None:
        click.echo("Error: " + " ".join(self.format_message().split()), err=True)


class OneLineCommand(click.Command):
    """A command whose parse errors (bad values, unknown options) are one line."""

    def make_context(self, info_name: Any, args: Any, parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as e:
            raise OneLineError(e.format_message(), e.ctx) from None


#: storage formats of a graph's intermediates (``--dtype``)
DTYPES = {
    "float32": FeatureChannelFormat.FLOAT32,
    "bfloat16": FeatureChannelFormat.BFLOAT16,
    "float16": FeatureChannelFormat.FLOAT16,
}

#: ``--model`` name -> (module, class); imported when used
MODELS = {
    "cnn": ("mpsnn.models.cnn", "SmallCNN"),
    "lenet": ("mpsnn.models.lenet", "LeNet5"),
    "apple-mnist": ("mpsnn.models.apple", "AppleMNIST"),
    "resnet18": ("mpsnn.models.resnet", "ResNet18"),
}

#: ``--optimizer`` name -> default learning rate
OPTIMIZERS = {"adam": 1e-3, "sgd": 0.05, "rmsprop": 1e-3}

#: SGD's momentum when ``--momentum`` is not given
SGD_MOMENTUM = 0.9

#: the largest ``--seed`` (seeds are 0 to 2^32 - 1, as NumPy's; a run derives the seed of each
#: epoch's order from it, which must stay within PyTorch's 64-bit seeds)
SEED_MAX = 2**32 - 1


def tune_cpu_allocator() -> None:
    """Keep freed heap memory in the process (glibc only; a no-op elsewhere).

    A training step frees and re-allocates tens of MB of intermediates; glibc's default
    thresholds hand that memory back to the OS after each step and fault it in again on the
    next — measured at 8-10 ms of page faults per LeNet step on a 2-core machine, as much as
    the step's arithmetic. The ``mpsnn`` command is the application, so it chooses: trim only
    above 512 MiB, and serve blocks up to 32 MiB (glibc's maximum) from the heap.
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_trim_threshold, 512 << 20)
    mallopt(m_mmap_threshold, 32 << 20)


def parse_device(name: str) -> Device:
    """``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``."""
    if name == "auto":
        return Device.default()
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name} needs a CUDA GPU, got none here (use --device cpu)")
    try:
        return Device(name)
    except (ValueError, TypeError) as exc:
        raise UserError(
            f"--device must be auto, cpu, cuda or cuda:N, got {name!r} ({exc})"
        ) from None


def model_class(name: str) -> type:
    import importlib

    if name not in MODELS:
        raise UserError(f"--model must be one of {', '.join(MODELS)}, got {name!r}")
    module, attr = MODELS[name]
    return getattr(importlib.import_module(module), attr)


def build_model(
    name: str,
    device: Device,
    optimizer: Any,
    *,
    seed: int,
    input_shape: tuple[int, int, int] | None = None,
    classes: int = 10,
) -> Any:
    """The model ``name`` with ``optimizer`` in its data sources; ``input_shape`` (C, H, W)
    for the models that adapt to it (all of ``MODELS``; each states the sizes it takes),
    checked against the others."""
    cls = model_class(name)
    kwargs: dict[str, Any] = {"seed": seed, "classes": classes}
    if input_shape is not None:
        if "input_shape" in _init_parameters(cls):
            kwargs["input_shape"] = input_shape
        elif tuple(input_shape) != tuple(cls.input_shape):
            shape = "x".join(map(str, input_shape))
            raise UserError(
                f"--model {name} takes {'x'.join(map(str, cls.input_shape))} images (C x H x W), "
                f"got {shape} from the dataset"
            )
    try:
        return cls(device, optimizer, **kwargs)
    except ValueError as exc:  # a shape or class count the model cannot take
        message = str(exc)
        if message.startswith("["):  # "[LeNet5] ...": the option names the model
            message = message.partition("] ")[2]
        raise UserError(f"--model {name}: {message}") from None


def _init_parameters(cls: type) -> set[str]:
    import inspect

    return set(inspect.signature(cls.__init__).parameters)


def make_optimizer(
    name: str,
    device: Device,
    lr: float | None,
    *,
    momentum: float | None = None,
    weight_decay: float = 0.0,
    clip_grad: float | None = None,
) -> Any:
    """One optimizer shared by every layer (one update per step): Adam, SGD with momentum
    ``momentum`` (None: `SGD_MOMENTUM`), or RMSProp; ``weight_decay`` > 0 is the descriptor's
    L2 regularization (the gradient gains ``weight_decay·w``), ``clip_grad`` its gradient
    clipping to ``[-clip_grad, clip_grad]``."""
    from mpsnn.optim import SGD, Adam, OptimizerDescriptor, RegularizationType, RMSProp

    if name not in OPTIMIZERS:
        raise UserError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    rate = OPTIMIZERS[name] if lr is None else lr
    if not rate > 0:
        raise UserError(f"--lr must be > 0, got {rate}")
    desc = OptimizerDescriptor(learning_rate=rate)
    if weight_decay:
        desc.regularization_type = RegularizationType.L2
        desc.regularization_scale = float(weight_decay)
    if clip_grad is not None:
        desc.apply_gradient_clipping = True
        desc.gradient_clip_min, desc.gradient_clip_max = -float(clip_grad), float(clip_grad)
    if name == "adam":
        return Adam(device, descriptor=desc)
    if name == "sgd":
        mu = SGD_MOMENTUM if momentum is None else momentum
        return SGD(device, momentum_scale=mu, descriptor=desc)
    return RMSProp(device, descriptor=desc)
