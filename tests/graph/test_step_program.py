"""The step program of a `Graph`'s eager ``encode_batch`` (`mpsnn.graph.program`): later
encodes of a lowered layout run the lowered step instead of encoding it again. Every test
compares against the same graph with ``reuse_step = False`` bit for bit (losses, results,
exported images, weights), and checks through ``graph._programs`` / ``.uses`` that the
program was (or was not) used."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mpsnn as m
from mpsnn.cli.common import DTYPES, build_model, make_optimizer, parse_device
from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.graph import program as program_module
from tests.graph._program_nets import (
    assert_same_losses,
    assert_same_sources,
    encode,
    small_data,
    small_training,
    train,
)

DEV = parse_device("cpu")

Data = list[tuple[torch.Tensor, torch.Tensor]]


# -- helpers -------------------------------------------------------------------------------


def _net(model: str = "lenet", opt: str = "adam") -> Any:
    return build_model(model, DEV, make_optimizer(opt, DEV, None), seed=0)


def _training(net: Any, batch: int, reuse: bool, fmt: str = "float32") -> m.Graph:
    graph = net.training_graph(batch, storage=DTYPES[fmt])
    graph.reuse_step = reuse
    return graph


def _data(net: Any, steps: int, batch: int, *, seed: int = 1, scale: float = 1.0) -> Data:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, *net.input_shape, generator=gen) * scale
        y = torch.randint(0, net.classes, (batch,), generator=gen)
        out.append((x, y))
    return out


def _weights(net: Any) -> dict[str, torch.Tensor]:
    return net.torch_module().state_dict()


def _assert_same_weights(na: Any, nb: Any) -> None:
    wa, wb = _weights(na), _weights(nb)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"weights {k} differ"


def _assert_trained(net: Any) -> None:
    """Some weight moved away from its initial value (the steps did update the model)."""
    start, now = net.twin.state_dict(), _weights(net)
    assert any(not torch.equal(start[k].to(now[k].dtype), now[k]) for k in now)


def _uses(graph: m.Graph) -> int:
    return sum(t.uses for t in graph._programs)


def _first_convolution_kernel(graph: m.Graph) -> Any:
    node = next(n for n in graph._plan.order if type(n) is m.ConvolutionNode)
    return graph._plan.kernels[node._id]


# -- 1. bit-for-bit equality over several steps --------------------------------------------

_CASES = [
    ("lenet", "adam", "float32", 8),
    ("lenet", "adam", "float16", 8),
    ("lenet", "adam", "bfloat16", 8),
    ("lenet", "sgd", "float64", 8),
    ("cnn", "rmsprop", "float32", 8),
    ("apple-mnist", "adam", "float32", 4),
    ("resnet18", "sgd", "float32", 4),
]
CASES = [c for c in _CASES if c[2] in DTYPES]  # the storage formats the CLI offers


@pytest.mark.parametrize(
    ("model", "opt", "fmt", "batch"), CASES, ids=["-".join(c[:3]) for c in CASES]
)
def test_program_steps_equal_ordinary_steps(model: str, opt: str, fmt: str, batch: int) -> None:
    """Five steps with the program give the ordinary encode's losses and weights bit for bit,
    and steps 2..5 run the one program lowered at step 1."""
    runs = []
    for reuse in (True, False):
        net = _net(model, opt)
        graph = _training(net, batch, reuse, fmt)
        losses = train(net, graph, _data(net, 5, batch))
        runs.append((net, graph, losses))
    (on_net, on_graph, on_losses), (off_net, off_graph, off_losses) = runs
    assert_same_losses(on_losses, off_losses)
    _assert_same_weights(on_net, off_net)
    _assert_trained(on_net)
    assert len(on_graph._programs) == 1
    assert _uses(on_graph) == 4
    assert off_graph._programs == []  # reuse_step = False lowers nothing
    assert all(bool(torch.isfinite(loss).all()) for loss in on_losses)


def test_dropout_masks_advance_under_the_program() -> None:
    """With the same batch at every step and a zero learning rate (only the dropout masks can
    change the loss), program steps draw new masks at every step, the ordinary ones'."""
    runs = []
    for reuse in (True, False):
        net = _net("apple-mnist", "adam")
        net.data_sources[0].optimizer.set_learning_rate(0.0)  # before any encode
        graph = _training(net, 4, reuse)
        (x, y) = _data(net, 1, 4)[0]
        runs.append((graph, train(net, graph, [(x, y)] * 4)))
    (on_graph, on_losses), (_, off_losses) = runs
    assert_same_losses(on_losses, off_losses)
    assert _uses(on_graph) == 3
    sums = [float(loss.sum()) for loss in on_losses]
    assert len(set(sums)) == len(sums), f"the masks did not advance: {sums}"


# -- 2. fresh outputs per step ---------------------------------------------------------------


def test_outputs_are_fresh_objects_per_step() -> None:
    """Each program step hands out new loss images and exported logits (an earlier step's are
    not overwritten by later steps), unreadable until committed, equal to the ordinary ones."""
    kept: dict[bool, tuple[list[Any], list[Any]]] = {}
    for reuse in (True, False):
        net = _net()
        graph = _training(net, 8, reuse)
        queue = DEV.new_command_queue()
        labels, exports = [], []
        for x, y in _data(net, 4, 8):
            cb = queue.command_buffer()
            lab = encode(graph, cb, x, y)
            with pytest.raises(ValueError, match="committed first"):
                lab.loss_image().tensor  # noqa: B018
            cb.commit()
            cb.wait_until_completed()
            labels.append(lab)
            exports.append(graph.intermediate_images)
        if reuse:
            assert _uses(graph) == 3
        kept[reuse] = (labels, exports)
    (on_labels, on_exports), (off_labels, off_exports) = kept[True], kept[False]
    loss_images = [lab.loss_image() for lab in on_labels]
    logits = [e[0] for e in on_exports]
    assert all(len(e) == 1 for e in on_exports)
    assert len({id(im) for im in loss_images}) == 4
    assert len({id(b.image) for b in logits}) == 4
    assert len({id(im.tensor) for im in loss_images}) == 4
    for i in range(4):  # read after every step ran
        assert torch.equal(loss_images[i].tensor, off_labels[i].loss_image().tensor), i
        assert torch.equal(logits[i].tensor, off_exports[i][0].tensor), i
        assert logits[i].tensor.shape == (8, 10, 1, 1)
    assert not torch.equal(logits[0].tensor, logits[3].tensor)


# -- 3. an inference graph -------------------------------------------------------------------


def _infer(graph: m.Graph, xs: list[torch.Tensor]) -> list[ImageBatch]:
    queue = DEV.new_command_queue()
    out = []
    for x in xs:
        cb = queue.command_buffer()
        out.append(graph.encode_batch(cb, [ImageBatch.from_tensor(x.clone())]))
        cb.commit()
        cb.wait_until_completed()
    return out


def test_inference_results_are_fresh_and_right() -> None:
    """An inference graph's program steps return new result images with the ordinary
    encode's values (read after every step), and the program is run."""
    xs = [x for x, _ in _data(_net(), 4, 6)]
    results = {}
    for reuse in (True, False):
        graph = _net().inference_graph()
        graph.reuse_step = reuse
        results[reuse] = _infer(graph, xs)
        if reuse:
            assert len(graph._programs) == 1 and graph._programs[0].uses == 3
    on, off = results[True], results[False]
    assert len({id(b.image) for b in on}) == 4
    for i in range(4):
        assert on[i].tensor.shape == (6, 10, 1, 1)
        assert torch.equal(on[i].tensor, off[i].tensor), i
    assert not torch.equal(on[0].tensor, on[1].tensor)


def test_inference_program_reads_reloaded_weights() -> None:
    """After training steps and ``reload_from_data_sources``, the inference graph's program
    computes with the new weights (equal to the ordinary encode, and not the old logits)."""
    results = {}
    for reuse in (True, False):
        net = _net()
        inference = net.inference_graph()
        inference.reuse_step = reuse
        training = _training(net, 8, reuse)
        data = _data(net, 3, 8)
        xs = [x for x, _ in data]
        # one step first: the optimizer's state is made then, which a program watches
        train(net, training, data[:1])
        inference.reload_from_data_sources()
        before = _infer(inference, xs[:2])
        train(net, training, data[1:])
        inference.reload_from_data_sources()
        after = _infer(inference, xs[:2])
        results[reuse] = (before, after)
        if reuse:
            assert inference._programs[0].uses == 3
    (on_before, on_after), (off_before, off_after) = results[True], results[False]
    for i in range(2):
        assert torch.equal(on_before[i].tensor, off_before[i].tensor), i
        assert torch.equal(on_after[i].tensor, off_after[i].tensor), i
        assert not torch.equal(on_after[i].tensor, on_before[i].tensor), i


# -- 4. invalidation ------------------------------------------------------------------------


def _edge_mode(net: Any, graph: m.Graph) -> None:
    _first_convolution_kernel(graph).edge_mode = m.EdgeMode.CLAMP


def _clipping(net: Any, graph: m.Graph) -> None:
    net.data_sources[0].optimizer.apply_gradient_clipping = True


def _format(net: Any, graph: m.Graph) -> None:
    graph.format = m.FeatureChannelFormat.FLOAT16


def _learning_rate(net: Any, graph: m.Graph) -> None:
    net.data_sources[0].optimizer.learning_rate = 0.01


# (change, invalidates, the first step whose loss it changes)
CHANGES = {
    "kernel edge_mode": (_edge_mode, True, 0),
    "gradient clipping": (_clipping, True, 1),
    "graph format": (_format, True, 0),
    "learning rate": (_learning_rate, False, 1),
}


@pytest.mark.parametrize("what", list(CHANGES))
def test_changes_invalidate_or_keep_the_program(what: str) -> None:
    """A changed kernel property, clipping switch or graph format is not run on the stale
    program (a new one is lowered), a new learning rate keeps it; the values equal the
    ordinary graph with the same change at the same step."""
    change, invalidates, effect = CHANGES[what]
    at, steps = 2, 5
    scale = 30.0  # gradients beyond the default clip range [-1, 1]: clipping changes them
    seen: dict[str, Any] = {}

    def before(i: int, net: Any, graph: m.Graph) -> None:
        if i == at:
            if graph.reuse_step:
                seen["old"] = graph._programs[0]
                assert seen["old"].uses == at - 1
            change(net, graph)

    runs = {}
    for label, reuse, hook in (("on", True, before), ("off", False, before), ("base", False, None)):
        net = _net("lenet", "adam")
        graph = _training(net, 8, reuse)
        runs[label] = (net, graph, train(net, graph, _data(net, steps, 8, scale=scale), hook))
    (on_net, on_graph, on_losses), (off_net, _, off_losses) = runs["on"], runs["off"]
    assert_same_losses(on_losses, off_losses)
    _assert_same_weights(on_net, off_net)
    base_losses = runs["base"][2]
    assert torch.equal(off_losses[at - 1], base_losses[at - 1])
    assert not torch.equal(off_losses[at + effect], base_losses[at + effect]), "no effect"
    old = seen["old"]
    if invalidates:
        assert old.uses == at - 1, "the stale program was run"
        new = on_graph._programs[0]
        assert new is not old
        assert new.uses == steps - at - 1
    else:
        assert on_graph._programs == [old], "a new program was lowered"
        assert old.uses == steps - 1


def test_set_learning_rate_keeps_the_program() -> None:
    """``optimizer.set_learning_rate`` between steps keeps the program (the rate lives in
    device memory) and gives the ordinary graph's values."""
    runs = []
    for reuse in (True, False):
        net = _net("lenet", "adam")
        graph = _training(net, 8, reuse)

        def before(i: int, net: Any, graph: m.Graph) -> None:
            if i >= 2:
                net.data_sources[0].optimizer.set_learning_rate(0.01 * i)

        runs.append((net, graph, train(net, graph, _data(net, 5, 8), before)))
    (on_net, on_graph, on_losses), (off_net, _, off_losses) = runs
    assert_same_losses(on_losses, off_losses)
    _assert_same_weights(on_net, off_net)
    assert len(on_graph._programs) == 1 and on_graph._programs[0].uses == 4


@pytest.mark.parametrize(("momentum", "reload"), [(0.0, True), (0.9, True), (0.0, False)])
def test_biases_given_to_a_bias_less_layer_are_trained(momentum: float, reload: bool) -> None:
    """Biases given to a bias-less layer after the program was lowered
    (``set_weights_and_biases`` + ``reload_from_data_sources``) are used and trained as by the
    ordinary encode; with momentum their optimizer state starts fresh beside the weights'."""
    data = small_data(8)
    runs = []
    for reuse in (True, False):
        graph, sources, _ = small_training("none", reuse, bias=False, momentum=momentum)

        def before(i: int, net: Any, graph: m.Graph, first: Any = sources[0]) -> None:
            if i == 2:
                first.set_weights_and_biases(first.weights(), torch.full((4,), 0.5))
                if reload:  # without: the step's update reloads the kernel (the bias appears)
                    graph.reload_from_data_sources()

        runs.append((graph, sources, train(None, graph, data, before)))
    (on_graph, on_sources, on_losses), (_, off_sources, off_losses) = runs
    assert _uses(on_graph) >= 1  # a program was lowered and used before the change
    assert not torch.equal(off_sources[0].bias_terms(), torch.full((4,), 0.5))  # trained
    on_bias, off_bias = on_sources[0].bias_terms(), off_sources[0].bias_terms()
    assert torch.equal(on_bias, off_bias), f"new biases: {on_bias} != {off_bias}"
    assert_same_sources(on_sources, off_sources)
    assert_same_losses(on_losses, off_losses)


# -- 5. steps encoded before either is committed --------------------------------------------


@pytest.mark.parametrize("buffers", ["two buffers", "two buffers, reversed", "one buffer"])
def test_steps_encoded_before_commit(buffers: str) -> None:
    """Two Adam steps encoded before either is committed (on two buffers committed in order or
    in the reverse order, or on one buffer) give the ordinary encode's losses and weights,
    committed the same way; one step program runs them all (each run binds its own inputs and
    its own time step, counted at encode: the commit order does not matter)."""
    runs = []
    for reuse in (True, False):
        net = _net("lenet", "adam")
        graph = _training(net, 8, reuse)
        queue = DEV.new_command_queue()
        data = _data(net, 6, 8)
        labels = []
        for k in range(0, 6, 2):
            cb_a = queue.command_buffer()
            cb_b = cb_a if buffers == "one buffer" else queue.command_buffer()
            labels.append(encode(graph, cb_a, *data[k]))
            labels.append(encode(graph, cb_b, *data[k + 1]))
            order = [cb_b, cb_a] if buffers.endswith("reversed") else [cb_a, cb_b]
            for cb in dict.fromkeys(order):  # one buffer: committed once
                cb.commit()
            order[-1].wait_until_completed()
        runs.append((net, graph, [lab.loss_image().tensor for lab in labels]))
    (on_net, on_graph, on_losses), (off_net, _, off_losses) = runs
    assert_same_losses(on_losses, off_losses)
    _assert_same_weights(on_net, off_net)
    _assert_trained(on_net)
    assert len(on_graph._programs) == 1
    assert _uses(on_graph) == 5


# -- 6. a new input layout -----------------------------------------------------------------


def test_new_input_layout_lowers_a_new_program() -> None:
    """A channels-last input and a smaller batch each lower a program of their own (another
    key), run for the next step of that layout; values equal the ordinary encode."""
    gen = torch.Generator().manual_seed(6)
    raw = [
        (torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen))
        for _ in range(6)
    ]
    last = torch.channels_last
    data = [raw[0], raw[1]]
    data += [(x.contiguous(memory_format=last), y) for x, y in raw[2:4]]
    data += [(x[:2], y[:2]) for x, y in raw[4:6]]
    assert data[2][0].stride() != raw[2][0].stride()
    recorded: list[Any] = []  # the program of each layout (the newest four are kept)

    def before(i: int, net: Any, graph: m.Graph) -> None:
        if graph.reuse_step and i in (2, 4):
            recorded.append(graph._programs[0])

    runs = []
    for reuse in (True, False):
        graph, sources, _ = small_training("none", reuse, cin=3)
        runs.append((graph, sources, train(None, graph, data, before)))
        if reuse:
            recorded.append(graph._programs[0])
    (_, on_sources, on_losses), (_, off_sources, off_losses) = runs
    assert_same_losses(on_losses, off_losses)
    assert_same_sources(on_sources, off_sources)
    assert len(recorded) == 3
    assert len({id(t) for t in recorded}) == 3
    assert len({t.key for t in recorded}) == 3
    assert [t.uses for t in recorded] == [1, 1, 1]


# -- 7. labels out of range ----------------------------------------------------------------


def test_out_of_range_labels_raise_as_without_program() -> None:
    """Labels with an index >= the classes, after a program exists, raise the ordinary
    encode's ValueError; the buffer is left usable and the program keeps working."""
    messages, runs = [], []
    for reuse in (True, False):
        net = _net()
        graph = _training(net, 8, reuse)
        data = _data(net, 3, 8)
        losses = train(net, graph, data[:2])
        cb = DEV.new_command_queue().command_buffer()
        x, y = data[2]
        bad = y.clone()
        bad[3] = 10  # 10 classes: indices 0..9
        labels = LossLabels(DEV, bad.view(-1, 1, 1))  # no max_index: the constructor scans
        assert labels._max_index == 10
        with pytest.raises(ValueError) as err:
            graph.encode_batch(cb, [ImageBatch.from_tensor(x.clone())], [labels])
        messages.append(str(err.value))
        assert len(cb) == 0
        if reuse:
            assert len(graph._programs) == 1 and graph._programs[0].uses == 1
        good = encode(graph, cb, x, y)
        cb.commit()
        cb.wait_until_completed()
        losses.append(good.loss_image().tensor.clone())
        if reuse:
            assert len(graph._programs) == 1 and graph._programs[0].uses == 2
        runs.append((net, losses))
    assert messages[0] == messages[1]
    assert "class indices must be < the 10 channels" in messages[0]
    assert_same_losses(runs[0][1], runs[1][1])
    _assert_same_weights(runs[0][0], runs[1][0])


# -- 8. a source written by an earlier command on the same buffer --------------------------


@pytest.mark.parametrize("image", ["new image per step", "same image every step"])
def test_source_written_earlier_on_the_same_buffer(image: str) -> None:
    """A permanent source image without storage at encode time, filled by a command recorded
    before the graph's on the same buffer, gives the ordinary encode's values."""
    runs = []
    for reuse in (True, False):
        net = _net()
        graph = _training(net, 8, reuse)
        queue = DEV.new_command_queue()
        desc = m.ImageDescriptor(m.FeatureChannelFormat.FLOAT32, 28, 28, 1, 8)
        shared = Image(DEV, desc)
        losses = []
        for x, y in _data(net, 4, 8):
            img = Image(DEV, desc) if image == "new image per step" else shared
            cb = queue.command_buffer()
            if image == "new image per step":
                assert img._storage is None

            def fill(img: Image = img, x: torch.Tensor = x) -> None:
                img._data().copy_(x)

            cb.record("fill", fill)
            labels = LossLabels(DEV, y.view(-1, 1, 1))
            graph.encode_batch(cb, [ImageBatch(img)], [labels])
            cb.commit()
            cb.wait_until_completed()
            losses.append(labels.loss_image().tensor.clone())
            assert torch.equal(img.tensor, x)
        runs.append((net, graph, losses))
    (on_net, on_graph, on_losses), (off_net, _, off_losses) = runs
    assert_same_losses(on_losses, off_losses)
    _assert_same_weights(on_net, off_net)
    # a new image has no storage at every encode (one key); the same image has from step 2
    assert _uses(on_graph) == (3 if image == "new image per step" else 2)


# -- 9. slots emptied by their own releases --------------------------------------------------


@pytest.mark.parametrize("model", ["lenet", "resnet18"])
def test_a_completed_step_leaves_every_slot_as_the_lowering_did(model: str) -> None:
    """Between steps the program's slots (the images and states the lowering made) hold no
    tensor and every other attribute as the first completed step left it: each slot is emptied
    by its own release, so nothing of a step reaches the next."""
    net = _net(model, "sgd")
    graph = _training(net, 4, True)
    queue = DEV.new_command_queue()
    data = _data(net, 3, 4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        cb = queue.command_buffer()
        encode(graph, cb, x, y)
        cb.commit()
        cb.wait_until_completed()

    step(*data[0])
    (program,) = graph._programs
    slots = [h.resource for h in program.hooks]
    assert slots and program.images

    def attrs(slot: Any) -> dict[str, Any]:  # containers copied: a run may fill them in place
        out = program_module._attrs(slot)
        return {k: v.copy() if isinstance(v, dict | list | set) else v for k, v in out.items()}

    first = [attrs(s) for s in slots]
    for x, y in data[1:]:
        step(x, y)
        for slot, before in zip(slots, first, strict=True):
            now = attrs(slot)
            assert not program_module._holds_tensor(slot), f"{slot!r} kept a tensor"
            assert now.keys() == before.keys(), slot
            for k, v in now.items():
                assert v is before[k] or v == before[k], f"{slot!r}.{k}: {before[k]!r} -> {v!r}"
    assert program.uses == 2
