"""The two training steps the tools compare: mpsnn's eager graph step (`mpsnn_graph_step`) and
the PyTorch twin's (`torch_twin_step`: the model's `torch_module`, on CUDA, channels-last with
autocast for float16/bfloat16, PyTorch's fast mixed-precision path), cross-entropy, and the
optimizer `mpsnn bench` uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mpsnn.cli.bench import _batch, _labels, _torch_optimizer
from mpsnn.cli.common import DTYPES, build_model, make_optimizer


@dataclass
class GraphStep:
    """An mpsnn training graph on fixed inputs (``images``, ``labels``): ``encode(cb)``
    encodes one step on ``cb``; ``step()`` encodes one on a new command buffer of ``queue``,
    commits it and returns it."""

    graph: Any
    queue: Any
    images: list[Any]
    labels: list[Any]
    encode: Callable[[Any], None]
    step: Callable[[], Any]


def mpsnn_graph_step(
    model: str, dev: Any, x: torch.Tensor, y: torch.Tensor, dtype: str, optimizer: str = "sgd"
) -> GraphStep:
    """``model``'s training graph (seed 0, ``dtype`` storage) stepping eagerly on ``(x, y)``."""
    net = build_model(model, dev, make_optimizer(optimizer, dev, None), seed=0,
                      input_shape=tuple(x.shape[1:]))  # fmt: skip
    graph = net.training_graph(x.shape[0], storage=DTYPES[dtype])
    queue = dev.new_command_queue()
    images, labels = [_batch(x, DTYPES[dtype])], [_labels(dev, y)]

    def encode(cb: Any) -> None:
        graph.encode_batch(cb, images, labels)

    def step() -> Any:
        cb = queue.command_buffer()
        encode(cb)
        cb.commit()
        return cb

    return GraphStep(graph, queue, images, labels, encode, step)


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
