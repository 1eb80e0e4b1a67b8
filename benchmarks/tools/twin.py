"""The PyTorch twin's training step the tools compare against: the model's `torch_module`, on
CUDA, channels-last with autocast for float16/bfloat16 (PyTorch's fast mixed-precision path),
cross-entropy, and the optimizer `mpsnn bench` uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mpsnn.cli.bench import _torch_optimizer
from mpsnn.cli.common import build_model


def torch_twin_step(
    model: str, dev: Any, x: torch.Tensor, y: torch.Tensor, dtype: str, optimizer: str = "sgd"
) -> Callable[[], None]:
    """One training step of ``model``'s twin on ``(x, y)`` (its weights initialized as mpsnn's
    with seed 0); ``dtype``: the mpsnn storage name (``bfloat16`` runs under autocast)."""
    net = build_model(model, dev, None, seed=0, input_shape=tuple(x.shape[1:])).torch_module()
    net = net.to(dev.torch_device)
    low = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    xs = x
    if low is not None:
        net = net.to(memory_format=torch.channels_last)
        xs = x.contiguous(memory_format=torch.channels_last)
    opt = _torch_optimizer(optimizer, net.parameters(), x.is_cuda)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=low or torch.bfloat16, enabled=low is not None):
            loss = F.cross_entropy(net(xs).float(), y)
        loss.backward()
        opt.step()

    return step
