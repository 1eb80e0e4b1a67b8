"""`TrainingLoop`: the steps of one model's training on one device, shared by `mpsnn.fit` and
``mpsnn train``.

A step is one call of the model's training graph — forward, softmax cross-entropy, every
gradient and the optimizer updates — encoded eagerly or replayed (``compile``: a CUDA graph on
GPUs, eager on the CPU). The loss and the number of correct predictions are summed on the
device (the training graph exports its logits) and read only when asked, so steps are not
synchronized one by one.

The training graph is built for ``batch_size`` images, its loss the batch mean (SUM with
weight ``1 / batch_size``); a process of a data-parallel run steps on its share of each batch
(``local_batch`` images) with that same weight. A batch of another size (the last one of a
``DataLoader`` that keeps it) runs eagerly through a training graph built for its size, over
the same data sources: with the default loss its loss is its own batch mean, as in PyTorch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mpsnn.cnn.loss import LossDescriptor
from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch

__all__ = ["EpochSums", "TrainingLoop", "epoch_order"]


def epoch_order(seed: int, epoch: int, count: int) -> torch.Tensor:
    """The order of epoch ``epoch`` (1-based) over ``count`` images: a permutation drawn from
    a generator seeded with ``(seed, epoch)``, so that a resumed run needs no saved state."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(count, generator=g)


@dataclasses.dataclass
class EpochSums:
    """Running sums of an epoch, on the device: ``loss`` (float64, the steps' batch-mean
    losses), ``correct`` (int64, correct predictions); ``steps`` and ``images`` counted on the
    host."""

    loss: torch.Tensor
    correct: torch.Tensor
    steps: int = 0
    images: int = 0


class TrainingLoop:
    """A model's training and inference graphs, a command queue, and the steps over them.

    Args:
        model: a `mpsnn.models.Model` whose data sources hold the optimizer that updates them.
        batch_size: the images of one step (the default loss's batch mean: ``1 / batch_size``).
        loss: the training graph's loss, for every batch size (default: softmax
            cross-entropy, the batch mean).
        storage: the format of the graphs' intermediates.
        local_batch: the images this process steps on (data parallel: its share of each
            batch; default ``batch_size``): the compiled step's batch.

    Attributes:
        graph, inference: the training graph and the inference graph.
        queue: the command queue the steps run on.
        step: the compiled training step once `compile` ran, else None (eager steps).
    """

    def __init__(
        self,
        model: Any,
        batch_size: int,
        *,
        loss: LossDescriptor | None = None,
        storage: FeatureChannelFormat = FeatureChannelFormat.FLOAT32,
        local_batch: int | None = None,
    ) -> None:
        self.model = model
        self.device = model.device
        self.torch_device = model.device.torch_device
        self.batch_size = batch_size
        self.local_batch = batch_size if local_batch is None else local_batch
        self.classes = model.classes
        self.loss = loss
        self.storage = storage
        self.graph = model.training_graph(batch_size, loss, storage=storage)
        self.inference = model.inference_graph(storage=storage)
        self.queue = self.device.new_command_queue()
        self.step: Any = None
        self._graphs = {self.local_batch: self.graph}

    def compile(self) -> Any:
        """Record the training step once and replay it (see `Graph.compile`); after setting
        the graph's ``data_parallel`` where there is one (its collectives are recorded)."""
        self.step = self.graph.compile(self.queue)
        return self.step

    def new_sums(self) -> EpochSums:
        t = self.torch_device
        return EpochSums(torch.zeros((), device=t, dtype=torch.float64),
                         torch.zeros((), device=t, dtype=torch.int64))  # fmt: skip

    def train_step(self, x: torch.Tensor, y: torch.Tensor, sums: EpochSums) -> None:
        """One step on images ``x`` ``(n, C, H, W)`` and labels ``y`` ``(n,)`` (int64, on the
        device); adds its loss and correct predictions to ``sums``."""
        n = len(x)
        # the classes are known: no scan of the device labels (which would wait)
        labels = LossLabels(self.device, y.view(-1, 1, 1), max_index=self.classes - 1)
        images = [ImageBatch(Image.from_tensor(storage_images(x, self.storage)))]
        graph = self._graph_for(n)
        if self.step is not None and n == self.local_batch:
            self.step(images, [labels])
            labels = self.step.source_states[0][0]
        else:
            cb = self.queue.command_buffer()
            graph.encode_batch(cb, images, [labels])
            cb.commit()
            if cb.error is not None:  # a failed collective (distributed) or command
                raise cb.error
        # on the device, ordered after the step on the queue's stream: no wait here
        sums.loss += labels.loss_image().tensor.sum()
        logits = graph.intermediate_images[0].tensor.flatten(1)
        sums.correct += (logits.argmax(1) == y).sum()
        sums.steps += 1
        sums.images += n

    def _graph_for(self, n: int) -> Any:
        graph = self._graphs.get(n)
        if graph is None:
            graph = self.model.training_graph(n, self.loss, storage=self.storage)
            self._graphs[n] = graph
        return graph

    def run_epoch(
        self,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        progress: Callable[[int, EpochSums], None] | None = None,
        every: int = 20,
        steps: int | None = None,
    ) -> EpochSums:
        """Train on every ``(images, labels)`` batch; ``progress(step, sums)`` after every
        ``every``-th step and after the last (``steps``: their number, where known)."""
        sums = self.new_sums()
        for i, (x, y) in enumerate(batches):
            self.train_step(x, y, sums)
            if progress is not None and ((i + 1) % every == 0 or i + 1 == steps):
                progress(i + 1, sums)
        return sums

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The inference graph's logits ``(n, classes)`` for images ``x`` (call
        `reload_weights` after training steps first)."""
        cb = self.queue.command_buffer()
        out = self.inference.encode_batch(
            cb, [ImageBatch(Image.from_tensor(storage_images(x, self.storage)))]
        )
        cb.commit()
        return out.tensor.flatten(1)

    def reload_weights(self) -> None:
        """Let the inference graph read the data sources' current weights."""
        self.inference.reload_from_data_sources()

    def count_correct(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch: int = 1000,
        after_batch: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Correct predictions of the current weights on ``x``, ``y`` (in batches of
        ``batch``), an int64 scalar on the device; ``after_batch()`` after each batch."""
        self.reload_weights()
        correct = torch.zeros((), device=self.torch_device, dtype=torch.int64)
        for i in range(0, len(x), batch):
            correct += (self.logits(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum()
            if after_batch is not None:
                after_batch()
        return correct


def storage_images(x: torch.Tensor, storage: FeatureChannelFormat | None = None) -> torch.Tensor:
    """``x`` in ``storage``'s dtype when that is float16 or bfloat16 and ``x`` is float32 (as
    PyTorch's autocast casts a convolution's input: the first layer then computes in the
    graph's format rather than in the images' wider float32); ``x`` otherwise."""
    dtype = None if storage is None else storage.dtype
    if x.dtype is torch.float32 and dtype in (torch.float16, torch.bfloat16):
        return x.to(dtype)
    return x
