"""The same training run in plain PyTorch (``mpsnn train --compare-torch``): the model's PyTorch
twin from the same initial weights, the same data in the same order, the same learning-rate
schedule and batch size, the equivalent torch optimizer, eager execution."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["train_torch"]


def _optimizer(name: str, params: Any, lr: float, cuda: bool) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, **({"fused": True} if cuda else {}))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.RMSprop(params, lr=lr, alpha=0.9, eps=1e-8)


def train_torch(trainer: Any, ui: Any) -> list[dict[str, Any]]:
    """Train ``trainer``'s model twin for ``trainer.config.epochs`` epochs; returns the history
    (same fields as mpsnn's, ``wall_seconds`` since the start)."""
    c = trainer.config
    dev = trainer.torch_device
    cuda = dev.type == "cuda"
    net = copy.deepcopy(trainer.model.twin).to(dev)
    opt = _optimizer(c.optimizer, net.parameters(), trainer.learning_rate(1), cuda)
    low = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(c.dtype)
    autocast = torch.autocast(dev.type, dtype=low, enabled=low is not None and cuda)
    scale = 1 / 255 if trainer.unorm8 else 1.0

    def inputs(x: torch.Tensor) -> torch.Tensor:
        return x.float() * scale if trainer.unorm8 else x

    history: list[dict[str, Any]] = []
    start = time.perf_counter()
    b = c.batch_size
    ui.console.print(f"pytorch {torch.__version__}: the same model, eager, {c.optimizer}")
    for epoch in range(1, c.epochs + 1):
        lr = trainer.learning_rate(epoch)
        for group in opt.param_groups:
            group["lr"] = lr
        order = trainer.order(epoch)
        steps = len(order) // b
        net.train()
        loss_sum = torch.zeros((), device=dev)
        correct = torch.zeros((), device=dev, dtype=torch.int64)
        t0 = time.perf_counter()
        for i in range(steps):
            idx = order[i * b : (i + 1) * b]
            x, y = inputs(trainer.train_x[idx]), trainer.train_y[idx]
            opt.zero_grad(set_to_none=True)
            with autocast:
                logits = net(x)
                loss = F.cross_entropy(logits.float(), y)
            loss.backward()
            opt.step()
            loss_sum += loss.detach()
            correct += (logits.argmax(1) == y).sum()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        net.eval()
        hits = 0
        with torch.no_grad(), autocast:
            for i in range(0, len(trainer.test_x), 1000):
                out = net(inputs(trainer.test_x[i : i + 1000]))
                hits += int((out.argmax(1) == trainer.test_y[i : i + 1000]).sum())
        record = {
            "epoch": epoch,
            "lr": lr,
            "train_loss": float(loss_sum) / steps,
            "train_accuracy": int(correct) / (steps * b),
            "train_seconds": seconds,
            "images_per_second": steps * b / seconds,
            "test_accuracy": hits / len(trainer.test_x),
            "wall_seconds": time.perf_counter() - start,
        }
        history.append(record)
        ui.console.print(
            f"pytorch epoch {epoch:>3}  loss {record['train_loss']:.4f}  "
            f"train acc {record['train_accuracy']:.4f}  test acc {record['test_accuracy']:.4f}  "
            f"{record['images_per_second']:,.0f} img/s  {seconds:.1f} s"
        )
    ui.table(history, "pytorch")
    return history
