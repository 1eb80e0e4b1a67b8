"""`Model.state_dict` / `Model.load_state_dict`: a PyTorch ``state_dict`` in the twin's names
goes into the data sources (OIHW and flattened-CHW weights to OHWI, batch-normalization gamma,
beta and running statistics) exactly, and a wrong one is refused naming what must hold."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import mpsnn as m
from mpsnn.models import AppleMNIST, LeNet5, Model, ResNet18, SmallCNN, TinyYOLOv2
from tests.helpers import assert_close
from tests.models._helpers import DEV, TOL, check_twin_holds_data_sources, logits, run, sgd

F64 = torch.float64

BUILDERS: dict[str, Callable[[int], Model]] = {
    "cnn": lambda seed: SmallCNN(DEV, seed=seed, dtype=F64),
    "lenet": lambda seed: LeNet5(DEV, seed=seed, dtype=F64),
    "apple-mnist": lambda seed: AppleMNIST(DEV, seed=seed, dtype=F64),
    # batch normalization, no biases, a shortcut with its own convolution; small and odd-sized
    "resnet18": lambda seed: ResNet18(DEV, seed=seed, dtype=F64, input_shape=(3, 9, 7), width=4),
    "tiny-yolo": lambda seed: TinyYOLOv2(
        DEV,
        seed=seed,
        dtype=F64,
        width=2,
        classes=2,
        anchor_boxes=[(1.0, 2.0)],
        input_shape=(3, 32, 32),
    ),
}


def _trained_twin(model: Model, seed: int) -> torch.nn.Module:
    """``model``'s twin with other weights, as a PyTorch user would have after training: random
    (never all-ones) weights and batch-normalization statistics."""
    twin = model.torch_module()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in twin.state_dict().items():
            if t.is_floating_point():
                noise = torch.rand(t.shape, generator=g, dtype=F64).to(t.dtype)
                t.copy_(noise + 0.5 if name.endswith("running_var") else noise - 0.5)
    return twin


@pytest.mark.parametrize("name", list(BUILDERS))
def test_load_state_dict_writes_the_twins_weights_into_the_data_sources(name: str) -> None:
    model = BUILDERS[name](0)
    twin = _trained_twin(BUILDERS[name](1), 2)
    model.load_state_dict(twin.state_dict())
    check_twin_holds_data_sources(model, twin)
    for key, value in model.state_dict().items():
        assert torch.equal(value, twin.state_dict()[key]), key
    if name != "tiny-yolo":  # (the detector's output layout is tested in its own file)
        shape = model.input_shape
        x = torch.randn(2, *shape, dtype=F64, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            expected = twin.eval()(x)
        assert_close(logits(model, x), expected.reshape(2, -1), f"{name} logits", TOL)


def test_load_state_dict_keeps_the_data_sources_memory_and_graphs_reload_it() -> None:
    """In place: the optimizer and a graph built before keep reading the same tensors; the
    graph sees the new values after ``reload_from_data_sources``."""
    model = LeNet5(DEV, sgd(), seed=0, dtype=F64)
    before = [ds.weights().data_ptr() for ds in model.data_sources]
    graph = model.inference_graph(storage=m.FeatureChannelFormat.FLOAT64)
    twin = _trained_twin(LeNet5(DEV, seed=1, dtype=F64), 4)
    model.load_state_dict(twin.state_dict())
    assert [ds.weights().data_ptr() for ds in model.data_sources] == before
    graph.reload_from_data_sources()
    x = torch.randn(3, 1, 28, 28, dtype=F64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = twin.eval()(x)
    assert_close(run(graph, x).tensor.reshape(3, -1), expected, "reloaded logits", TOL)


def test_load_state_dict_rounds_into_the_data_sources_dtype() -> None:
    model = SmallCNN(DEV)  # float32 data sources
    twin = _trained_twin(SmallCNN(DEV, seed=1, dtype=F64), 6)  # float64 values
    model.load_state_dict(twin.state_dict())
    for ds, (_, t) in zip(model.data_sources, list(twin.state_dict().items())[::2], strict=True):
        assert ds.weights().dtype == torch.float32
        assert torch.equal(ds.weights().permute(0, 3, 1, 2).reshape(t.shape), t.float())


def test_load_state_dict_refuses_a_state_dict_of_another_model() -> None:
    model = LeNet5(DEV)
    good = model.state_dict()
    missing = {k: v for k, v in good.items() if k != "9.bias"}
    with pytest.raises(ValueError, match=r"\[LeNet5\] state_dict must hold exactly the twin's "
                       r"tensors.*missing \['9.bias'\]"):  # fmt: skip
        model.load_state_dict(missing)
    extra = {**good, "13.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"unexpected \['13.weight'\]"):
        model.load_state_dict(extra)
    wrong = {**good, "0.weight": torch.zeros(6, 1, 3, 3)}
    with pytest.raises(ValueError, match=r"\[LeNet5\] state_dict\['0.weight'\] must have the "
                       r"shape \(6, 1, 5, 5\), got \(6, 1, 3, 3\)"):  # fmt: skip
        model.load_state_dict(wrong)
    with pytest.raises(TypeError, match=r"\[LeNet5\] state_dict\['0.bias'\] must be a tensor, "
                       r"got list"):  # fmt: skip
        model.load_state_dict({**good, "0.bias": [0.0] * 6})
    with pytest.raises(TypeError, match=r"\[LeNet5\] state_dict must be a mapping"):
        model.load_state_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"state_dict\['0.weight'\] must be a floating-point "
                       r"tensor, got torch.int64"):  # fmt: skip
        model.load_state_dict({**good, "0.weight": torch.zeros(6, 1, 5, 5, dtype=torch.int64)})
    # nothing was written by a refused call
    assert all(torch.equal(a, b) for a, b in zip(good.values(), model.state_dict().values(),
                                                 strict=True))  # fmt: skip


def test_load_state_dict_accepts_a_state_dict_without_batch_counters() -> None:
    """``num_batches_tracked`` is PyTorch bookkeeping that mpsnn does not keep: optional."""
    model = BUILDERS["resnet18"](0)
    twin = _trained_twin(BUILDERS["resnet18"](1), 7)
    state = {k: v for k, v in twin.state_dict().items() if not k.endswith("num_batches_tracked")}
    model.load_state_dict(state)
    check_twin_holds_data_sources(model, twin)
