"""The same training run in plain PyTorch (``mpsnn train --compare-torch``): the model's PyTorch
twin from the same initial weights, the same data in the same order, the same learning rate
at every step (`mpsnn.cli.schedules`), batch size, momentum, weight decay, gradient clipping
and label smoothing, the equivalent torch optimizer, eager execution.

The update options map to torch's: the descriptor's L2 regularization is ``weight_decay``
(added to the gradient before the rule, as MPS does), its gradient clipping
``clip_grad_value_`` before the step (MPS clips first too), the loss's label smoothing
``F.cross_entropy(label_smoothing=...)``. One difference remains where the rate changes
between steps: MPS's SGD keeps ``m = μm + lr·g`` and torch's ``m = μm + g`` (see
`mpsnn.optim.rules`)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from mpsnn.cli.schedules import sgd_momentum

__all__ = ["torch_loss", "torch_optimizer", "train_torch"]


def torch_optimizer(config: Any, params: Any, lr: float, cuda: bool) -> torch.optim.Optimizer:
    """The torch optimizer of a run's `TrainConfig` (MPS's RMSProp: decay 0.9, ε 1e-8)."""
    decay = config.weight_decay
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=decay,
                                **({"fused": True} if cuda else {}))  # fmt: skip
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=sgd_momentum(config.momentum),
                               weight_decay=decay)  # fmt: skip
    return torch.optim.RMSprop(params, lr=lr, alpha=0.9, eps=1e-8, weight_decay=decay)


def torch_loss(config: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The batch-mean cross entropy of a run, with its label smoothing."""
    smoothing = config.label_smoothing

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels, label_smoothing=smoothing)

    return loss


def train_torch(trainer: Any, ui: Any) -> list[dict[str, Any]]:
    """Train ``trainer``'s model twin for ``trainer.config.epochs`` epochs, shown by ``ui`` (a
    `mpsnn.cli.progress.Display`); returns the history (same fields as mpsnn's,
    ``wall_seconds`` since the start)."""
    c = trainer.config
    dev = trainer.torch_device
    cuda = dev.type == "cuda"
    net = copy.deepcopy(trainer.model.twin).to(dev)
    opt = torch_optimizer(c, net.parameters(), trainer.learning_rate(1), cuda)
    criterion = torch_loss(c)
    clip = c.clip_grad
    low = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(c.dtype)
    autocast = torch.autocast(dev.type, dtype=low, enabled=low is not None and cuda)
    scale = 1 / 255 if trainer.unorm8 else 1.0

    def inputs(x: torch.Tensor) -> torch.Tensor:
        return x.float() * scale if trainer.unorm8 else x

    def set_rate(lr: float) -> None:
        for group in opt.param_groups:
            group["lr"] = lr

    history: list[dict[str, Any]] = []
    start = time.perf_counter()
    b = c.batch_size
    ui.print(f"pytorch {torch.__version__}: the same model, eager, {c.optimizer}")

    def one_epoch(epoch: int, progress: Any, due: Any) -> dict[str, Any]:
        lr = trainer.learning_rate(epoch)
        set_rate(lr)
        order = trainer.order(epoch)
        steps = len(order) // b
        net.train()
        loss_sum = torch.zeros((), device=dev, dtype=torch.float64)
        correct = torch.zeros((), device=dev, dtype=torch.int64)
        t0 = time.perf_counter()
        for i in range(steps):
            if i and trainer.schedule.per_step:
                set_rate(trainer.learning_rate(epoch, i))
            idx = order[i * b : (i + 1) * b]
            x, y = inputs(trainer.train_x[idx]), trainer.train_y[idx]
            opt.zero_grad(set_to_none=True)
            with autocast:
                logits = net(x)
                loss = criterion(logits.float(), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_value_(net.parameters(), clip)
            opt.step()
            loss_sum += loss.detach()
            correct += (logits.argmax(1) == y).sum()
            if due(i + 1, steps):
                progress(i + 1, steps, float(loss_sum) / (i + 1), int(correct) / ((i + 1) * b))
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        net.eval()
        hits = 0
        with torch.no_grad(), autocast:
            for i in range(0, len(trainer.test_x), 1000):
                out = net(inputs(trainer.test_x[i : i + 1000]))
                hits += int((out.argmax(1) == trainer.test_y[i : i + 1000]).sum())
        return {
            "epoch": epoch,
            "lr": lr,
            "train_loss": float(loss_sum) / steps,
            "train_accuracy": int(correct) / (steps * b),
            "train_seconds": seconds,
            "images_per_second": steps * b / seconds,
            "test_accuracy": hits / len(trainer.test_x),
        }

    for epoch in range(1, c.epochs + 1):
        record = ui.run_epoch(
            "pytorch", epoch, c.epochs, b, trainer.learning_rate,
            lambda progress, due, e=epoch: one_epoch(e, progress, due),
        )  # fmt: skip
        record["wall_seconds"] = time.perf_counter() - start
        history.append(record)
        ui.log.epoch("pytorch", record)
    ui.table(history, "pytorch")
    return history
