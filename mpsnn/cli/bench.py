"""``mpsnn bench``: one model's training step (forward, loss, backward, optimizer) as an mpsnn
graph — encoded eagerly and replayed — side by side with the same model in PyTorch eager and
under ``torch.compile``, same architecture, batch, dtype, optimizer and data.

Step time is measured in steady state: a run of steps back to back, one synchronization, the
wall time divided by the steps (what a training loop pays, host and device), median of several
runs. Peak memory (CUDA) is what the variant allocated at its peak, from before it was built
(weights, optimizer state, activations, gradients, workspaces) — each variant is built, timed
and freed before the next. ``--dtype bfloat16``/``float16``: mpsnn stores the graph's
intermediates in that format with float32 master weights; PyTorch runs under autocast with
channels-last tensors (its fast mixed-precision path).
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch
import torch.nn.functional as F

from mpsnn.cli.common import (
    DTYPES,
    MODELS,
    OPTIMIZERS,
    OneLineCommand,
    UserError,
    build_model,
    make_optimizer,
)
from mpsnn.cli.runs import check_file, writing

__all__ = ["bench", "measure"]


def _timed(step: Callable[[], None], sync: Callable[[], None], steps: int, trials: int) -> float:
    runs = []
    for _ in range(trials):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        runs.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(runs)


def measure(
    model: str = "lenet",
    batch: int = 256,
    dtype: str = "float32",
    device: str = "cuda",
    optimizer: str = "adam",
    steps: int = 50,
    trials: int = 5,
    compile_modes: tuple[str, ...] = ("default",),
    input_shape: tuple[int, int, int] | None = None,
    variants: tuple[str, ...] = ("mpsnn-eager", "mpsnn-replay", "torch-eager", "torch-compile"),
) -> dict[str, Any]:
    """Time each variant; returns ``{"rows": [{variant, ms, images_per_s, peak_mib, loss}],
    "host_encode_ms": ..., ...}``."""
    from mpsnn.cli.common import model_class, parse_device

    dev = parse_device(device)
    tdev = dev.torch_device
    cuda = tdev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shape = tuple(input_shape or model_class(model).input_shape)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=gen).to(tdev)
    y = torch.randint(0, 10, (batch,), generator=gen).to(tdev)
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}

    def memory_start() -> int:
        gc.collect()
        if not cuda:
            return 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def row(name: str, ms: float, base: int, loss: float) -> None:
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
        rows.append({"variant": name, "ms": ms, "images_per_s": batch / ms * 1e3,
                     "peak_mib": peak, "loss": loss})  # fmt: skip

    # -- mpsnn ---------------------------------------------------------------------------
    for variant in ("mpsnn-eager", "mpsnn-replay"):
        if variant not in variants:
            continue
        base = memory_start()
        net, graph, queue, images, labels, step = _mpsnn_eager(
            model, dev, optimizer, shape, batch, dtype, x, y
        )
        if variant == "mpsnn-eager":
            for _ in range(3):
                step()
            ms = _timed(step, sync, steps, trials)
            loss = float(labels[0].loss_image().tensor.sum())
            host = []
            for _ in range(max(steps, 20)):
                cb = queue.command_buffer()
                t0 = time.perf_counter()
                graph.encode_batch(cb, images, labels)
                host.append(time.perf_counter() - t0)
                cb.commit()
            sync()
            extra["host_encode_ms"] = 1e3 * statistics.median(host)
            extra["memory_plan"] = graph.debug_description().splitlines()[-1].strip()
            name = "mpsnn graph, eager"
        else:
            compiled = graph.compile(queue)

            def step(compiled: Any = compiled, images: Any = images, labels: Any = labels) -> None:
                compiled(images, labels)

            for _ in range(3):
                step()
            ms = _timed(step, sync, steps, trials)
            compiled.wait_until_completed()
            loss = float(compiled.source_states[0][0].loss_image().tensor.sum())
            name = "mpsnn graph, replayed" if compiled.is_captured else "mpsnn graph, compiled"
        row(name, ms, base, loss)
        del net, graph, queue, step
    # -- PyTorch -------------------------------------------------------------------------
    torch_modes = (["eager"] if "torch-eager" in variants else []) + (
        list(compile_modes) if "torch-compile" in variants else []
    )
    for mode in torch_modes:
        base = memory_start()
        step, last = _torch_step(model, dev, optimizer, shape, dtype, x, y, mode)
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        sync()
        if mode != "eager":
            extra[f"torch.compile ({mode}) warm-up s"] = time.perf_counter() - t0
        ms = _timed(step, sync, steps, trials)
        row("pytorch eager" if mode == "eager" else f"torch.compile ({mode})", ms, base,
            float(last[0]))  # fmt: skip
        del step, last
    return {"model": model, "batch": batch, "dtype": dtype, "optimizer": optimizer,
            "device": dev.name, "torch": torch.__version__, "rows": rows, **extra}  # fmt: skip


def _mpsnn_eager(
    model: str, dev: Any, optimizer: str, shape: tuple[int, ...], batch: int, dtype: str,
    x: torch.Tensor, y: torch.Tensor,
) -> tuple[Any, Any, Any, list[Any], list[Any], Callable[[], None]]:  # fmt: skip
    """``(net, graph, queue, images, labels, step)``: the model's training graph and one eager
    step (encode_batch + commit, no wait)."""
    net = build_model(model, dev, make_optimizer(optimizer, dev, None), seed=0,
                      input_shape=shape)  # fmt: skip
    graph = net.training_graph(batch, storage=DTYPES[dtype])
    queue = dev.new_command_queue()
    images, labels = [_batch(x, DTYPES[dtype])], [_labels(dev, y)]

    def step() -> None:
        cb = queue.command_buffer()
        graph.encode_batch(cb, images, labels)
        cb.commit()

    return net, graph, queue, images, labels, step


def _torch_step(
    model: str, dev: Any, optimizer: str, shape: tuple[int, ...], dtype: str,
    x: torch.Tensor, y: torch.Tensor, mode: str = "eager",
) -> tuple[Callable[[], None], list[torch.Tensor]]:  # fmt: skip
    """The same model's PyTorch step (``mode``: "eager" or a ``torch.compile`` mode) and the
    one-element list its last loss is kept in. Half types: autocast and channels-last."""
    tdev = dev.torch_device
    cuda = tdev.type == "cuda"
    low = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    net = build_model(model, dev, None, seed=0, input_shape=shape).torch_module().to(tdev)
    xs = x
    if low is not None and cuda:
        net = net.to(memory_format=torch.channels_last)
        xs = x.contiguous(memory_format=torch.channels_last)
    opt = _torch_optimizer(optimizer, net.parameters(), cuda)
    compile_mode = None if mode == "default" else mode
    fwd = net if mode == "eager" else torch.compile(net, mode=compile_mode)
    last = [torch.zeros((), device=tdev)]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(tdev.type, dtype=low or torch.bfloat16, enabled=low is not None):
            loss = F.cross_entropy(fwd(xs).float(), y)
        loss.backward()
        opt.step()
        last[0] = loss.detach()

    return step, last


def _torch_optimizer(name: str, params: Any, cuda: bool) -> torch.optim.Optimizer:
    """The torch optimizer matching ``make_optimizer(name)`` (fused Adam on CUDA)."""
    rate = OPTIMIZERS[name]
    if name == "adam":
        return torch.optim.Adam(params, lr=rate, **({"fused": True} if cuda else {}))
    if name == "sgd":
        return torch.optim.SGD(params, lr=rate, momentum=0.9)
    return torch.optim.RMSprop(params, lr=rate, alpha=0.9)


def _batch(x: torch.Tensor, storage: Any = None) -> Any:
    """``x`` as a source batch, in the graph's ``storage`` format when that is a narrower
    floating-point one (as PyTorch's autocast casts a convolution's input: the first layer
    then computes in that format rather than in the wider float32 of the images)."""
    from mpsnn.core.image_batch import ImageBatch
    from mpsnn.training.loop import storage_images

    return ImageBatch.from_tensor(storage_images(x, storage))


def _labels(dev: Any, y: torch.Tensor) -> Any:
    from mpsnn.cnn.loss_labels import LossLabels

    return LossLabels(dev, y.view(-1, 1, 1))


@click.command(cls=OneLineCommand)
@click.option("--model", type=click.Choice(list(MODELS)), default="lenet", show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True)
@click.option("--optimizer", type=click.Choice(list(OPTIMIZERS)), default="adam", show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option(
    "--input-shape",
    default=None,
    help="C,H,W of the synthetic images [default: the model's own, e.g. 3,32,32 for resnet18].",
)
@click.option("--steps", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--trials", type=click.IntRange(min=1), default=5, show_default=True)
@click.option(
    "--compile-modes",
    default="default",
    show_default=True,
    help="Comma-separated torch.compile modes ('' for none).",
)
@click.option(
    "--variants",
    default="mpsnn-eager,mpsnn-replay,torch-eager,torch-compile",
    show_default=True,
    help="Comma-separated subset to run.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the results here.",
)
def bench(**o: Any) -> None:  # fmt: skip
    """Time one model's training step: mpsnn (eager, replayed) beside PyTorch (eager,
    torch.compile)."""
    from rich.console import Console
    from rich.table import Table

    shape = None
    if o["input_shape"]:
        try:
            shape = tuple(int(v) for v in o["input_shape"].split(","))
            if len(shape) != 3 or min(shape) < 1:
                raise ValueError
        except ValueError:
            raise UserError(f"--input-shape must be C,H,W, got {o['input_shape']!r}") from None
    device = o["device"] if o["device"] != "auto" else ("cuda" if torch.cuda.is_available()
                                                        else "cpu")  # fmt: skip
    steps, trials = o["steps"], o["trials"]
    if device == "cpu":  # CPU steps are slow: keep the run short
        steps, trials = min(steps, 5), min(trials, 3)
    modes = tuple(m for m in o["compile_modes"].split(",") if m)
    known = ("mpsnn-eager", "mpsnn-replay", "torch-eager", "torch-compile")
    variants = tuple(v for v in o["variants"].split(",") if v)
    if not variants or any(v not in known for v in variants):
        raise UserError(f"--variants must be a subset of {','.join(known)}, got {o['variants']!r}")
    if o["json_path"] is not None:  # before the timings, not after them
        check_file(o["json_path"], "--json")
    out = measure(o["model"], o["batch_size"], o["dtype"], device, o["optimizer"], steps,
                  trials, modes, shape, variants)  # fmt: skip
    console = Console()
    table = Table(title=f"{o['model']} training step: batch {o['batch_size']}, {o['dtype']}, "
                        f"{o['optimizer']}, {out['device']}, torch {out['torch']}")  # fmt: skip
    for col in ("variant", "ms/step", "images/s", "vs pytorch eager", "peak MiB", "loss"):
        table.add_column(col, justify="right")
    ref = next((r["ms"] for r in out["rows"] if r["variant"] == "pytorch eager"), None)
    for r in out["rows"]:
        table.add_row(
            r["variant"], f"{r['ms']:.3f}", f"{r['images_per_s']:,.0f}",
            f"{ref / r['ms']:.2f}x" if ref else "",
            "" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}", f"{r['loss']:.4f}",
        )  # fmt: skip
    console.print(table)
    if "host_encode_ms" in out:
        console.print(f"host time of one eager encode_batch: {out['host_encode_ms']:.3f} ms; "
                      f"{out['memory_plan']}")  # fmt: skip
    if o["json_path"] is not None:
        with writing("the results", o["json_path"]):
            o["json_path"].write_text(json.dumps(out, indent=1))
