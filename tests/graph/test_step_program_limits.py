"""Where the step program (`mpsnn.graph.program`) must step aside: user code an encode
calls (a data source, optimizer or padding policy of the user's), tensors made under
inference mode, the labels' class count a compiled step checks, and graphs whose lowerings
cannot be kept (they stop lowering). Each compares with ``reuse_step = False``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mpsnn as m
from mpsnn.cli.common import build_model, make_optimizer, parse_device
from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.geometry import PaddingMethod
from mpsnn.core.image_batch import ImageBatch
from tests.graph._program_nets import (
    assert_same_losses,
    assert_same_sources,
    small_data,
    small_training,
    train,
)

DEV = parse_device("cpu")


class _SwitchablePadding:
    """SAME padding, or a smaller ('valid') destination once ``valid`` is set; counts calls."""

    def __init__(self) -> None:
        self.valid = False
        self.calls = 0

    @property
    def padding_method(self) -> PaddingMethod:
        return PaddingMethod.SIZE_SAME | PaddingMethod.CUSTOM

    def destination_image_descriptor(self, images: Any, states: Any, kernel: Any, desc: Any) -> Any:
        self.calls += 1
        if not self.valid:
            return desc
        return ImageDescriptor(desc.channel_format, desc.width - 2, desc.height - 2,
                               desc.feature_channels, desc.number_of_images)  # fmt: skip


def test_a_custom_padding_policy_is_called_at_every_encode() -> None:
    """A user's padding policy (user code an encode calls) keeps the graph off the program:
    it is called at every encode and its answer is followed, as with ``reuse_step = False``."""
    runs = {}
    for reuse in (True, False):
        gen = torch.Generator().manual_seed(0)
        d = m.ConvolutionDescriptor(3, 3, 1, 2)
        w = torch.randn(d.weights_shape, generator=gen)
        node = m.ConvolutionNode(m.ImageNode("x"), m.TensorConvolutionDataSource(d, w, None))
        policy = _SwitchablePadding()
        node.padding_policy = policy
        graph = m.Graph(DEV, node.result_image)
        graph.reuse_step = reuse
        q = DEV.new_command_queue()
        outs = []
        for i in range(4):
            policy.valid = i >= 2
            cb = q.command_buffer()
            x = torch.randn(2, 1, 8, 8, generator=gen)
            out = graph.encode_batch(cb, [ImageBatch.from_tensor(x)])
            cb.commit()
            outs.append(out.tensor.clone())
        runs[reuse] = (outs, policy.calls, graph._programs)
    (on, on_calls, programs), (off, off_calls, _) = runs[True], runs[False]
    assert [t.shape for t in on] == [(2, 2, 8, 8)] * 2 + [(2, 2, 6, 6)] * 2
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    assert on_calls == off_calls == 4 and programs == []


def test_no_program_is_lowered_under_inference_mode() -> None:
    """A step encoded under ``torch.inference_mode()`` is not lowered (the tensors an encode
    makes there cannot be updated outside it): later steps outside it run as without a
    program."""
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen))
               for n in (4, 2, 2, 2)]  # fmt: skip
    runs = {}
    for reuse in (True, False):
        net = build_model("apple-mnist", DEV, make_optimizer("adam", DEV, None), seed=0)
        graph = net.training_graph(4)
        graph.reuse_step = reuse
        q = DEV.new_command_queue()
        losses = []
        for i, (x, y) in enumerate(batches):
            with torch.inference_mode(i == 1):
                cb = q.command_buffer()
                lab = LossLabels(DEV, y.view(-1, 1, 1))
                graph.encode_batch(cb, [ImageBatch.from_tensor(x.clone())], [lab])
                cb.commit()
            assert cb.error is None, cb.error
            losses.append(lab.loss_image().tensor.clone())
        runs[reuse] = losses
    assert all(torch.equal(a, b) for a, b in zip(runs[True], runs[False], strict=True))


def test_labels_get_the_class_count_when_reused() -> None:
    """Labels that already carry the predictions' class count (one LossLabels encoded twice)
    still hand it on: a run step sets it on new labels, which a compiled step's refill
    checks class indices against."""
    net = build_model("lenet", DEV, make_optimizer("sgd", DEV, None), seed=0)
    graph = net.training_graph(4)
    q = DEV.new_command_queue()
    x = torch.randn(4, 1, 28, 28)
    same = LossLabels(DEV, torch.randint(0, 10, (4, 1, 1)))
    for labels in (same, same, same, LossLabels(DEV, torch.randint(0, 10, (4, 1, 1)))):
        cb = q.command_buffer()
        graph.encode_batch(cb, [ImageBatch.from_tensor(x)], [labels])
        cb.commit()
        assert labels._classes == 10
    assert sum(t.uses for t in graph._programs) >= 1


def test_a_graph_whose_lowerings_are_not_kept_stops_lowering() -> None:
    """A graph whose lowerings cannot be kept (a layer without an optimizer: its update
    exports a weights state and adds a completed handler) stops lowering after three tries:
    its encodes run in full, with the values of ``reuse_step = False``."""
    runs = {}
    for reuse in (True, False):
        net = build_model("lenet", DEV, make_optimizer("sgd", DEV, None), seed=0)
        net.data_sources[0]._optimizer = None  # frozen, as if made with optimizer=None
        graph = net.training_graph(4)
        graph.reuse_step = reuse
        q = DEV.new_command_queue()
        gen = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(6):
            cb = q.command_buffer()
            lab = LossLabels(DEV, torch.randint(0, 10, (4, 1, 1), generator=gen))
            x = torch.randn(4, 1, 28, 28, generator=gen)
            graph.encode_batch(cb, [ImageBatch.from_tensor(x)], [lab])
            cb.commit()
            cb.wait_until_completed()
            losses.append(lab.loss_image().tensor.clone())
        runs[reuse] = (losses, graph)
    (on, graph), (off, _) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
    assert graph._programs == [] and graph._lowering_refusals == 3


@pytest.mark.parametrize("custom", ["data source", "optimizer", "none"])
def test_user_data_sources_and_optimizers_get_no_program(custom: str) -> None:
    """A data source or optimizer defined outside mpsnn lowers no program and its update
    runs at every step (mpsnn's own: a program, run); values equal the ordinary
    encode."""
    data = small_data(4)
    runs = []
    for reuse in (True, False):
        graph, sources, counted = small_training(custom, reuse)
        losses = train(None, graph, data)
        runs.append((graph, sources, counted, losses))
    (on_graph, on_sources, counted, on_losses), (_, off_sources, _, off_losses) = runs
    assert_same_losses(on_losses, off_losses)
    assert_same_sources(on_sources, off_sources)
    if custom == "none":
        assert len(on_graph._programs) == 1 and on_graph._programs[0].uses == 3
    else:
        assert on_graph._programs == []
        assert counted.calls == 4
