"""The README's main job: the Fashion-MNIST example trains (a short run, every gradient kernel of
the network in the loop) and reaches a non-trivial test accuracy; the port of Apple's sample
keeps the sample's data-source contract."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import mpsnn as m
from mpsnn.data.fashion_mnist import find_fashion_mnist

ROOT = Path(__file__).resolve().parents[1]


def test_example_trains_on_fashion_mnist() -> None:
    try:
        find_fashion_mnist()
    except FileNotFoundError as exc:  # CI installs the data (scripts/setup.sh); say so if not
        pytest.fail(f"Fashion-MNIST is missing: {exc}")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_fashion_mnist.py"), "--epochs", "1", "--limit", "3200", "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    accuracy = float(re.findall(r"test accuracy ([0-9.]+)", out)[-1])
    loss = float(re.findall(r"loss ([0-9.]+)", out)[-1])
    assert loss < 2.0, out  # the epoch's mean loss, well under chance level ln(10) = 2.30
    assert accuracy > 0.65, out  # 10 classes: chance is 0.10


def test_readme_api_tour_runs() -> None:
    """The README's Python blocks run in order, as one script, and print what they claim."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(blocks) >= 3, "the README's API tour lost its code blocks"
    namespace: dict[str, object] = {}
    exec(compile("\n".join(blocks), "README.md", "exec"), namespace)
    assert tuple(namespace["dx"].shape) == (8, 16, 32, 32)
    assert tuple(namespace["states"][0].gradient_for_weights.shape) == (32, 3, 3, 16)
    assert tuple(namespace["dy"].shape) == tuple(namespace["y"].shape)
    assert "fused RELU" in namespace["train"].debug_description()


def _apple_mnist() -> Any:
    """examples/apple_mnist.py as a module (its data source, network recipe and handler)."""
    spec = importlib.util.spec_from_file_location(
        "apple_mnist", ROOT / "examples" / "apple_mnist.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_apple_mnist_data_source_trains_its_own_buffers_and_inference_sees_them() -> None:
    """The sample's data-source pattern (own buffers wrapped by the state Adam writes, own step
    count asserted against Adam's after each encode), a few steps of the sample's training graph
    on synthetic 28x28 images (narrow layers, CPU): the data sources' own tensors are the
    state's memory and changed; the inference graph reloaded from them predicts exactly as one
    built from fresh data sources holding copies of the trained weights, not as the initial
    weights do."""
    ex = _apple_mnist()
    dev = m.Device("cpu")
    gen = torch.Generator().manual_seed(0)
    shapes = ((4, 5, 5, 1), (8, 5, 5, 4), (16, 7, 7, 8), (10, 1, 1, 16))
    params = [(torch.rand(s, generator=gen) * 0.4 - 0.2, torch.full((s[0],), 0.1)) for s in shapes]
    names = ("conv1", "conv2", "fc1", "fc2")
    sources = [ex.AdamDataSource(dev, w, b, n) for (w, b), n in zip(params, names, strict=True)]
    exits = ex.build_network(sources, training=True).training_graph(None, ex.gradients_in_float32)
    train = m.Graph(dev, exits[0].result_image, True)
    infer = m.Graph(dev, ex.build_network(sources, training=False).result_image, True)
    queue = dev.new_command_queue()
    batch = 6
    test_x = torch.randint(0, 256, (batch, 1, 28, 28), generator=gen, dtype=torch.uint8)

    def predict(graph: m.Graph) -> torch.Tensor:
        cb = queue.command_buffer()
        probs = graph.encode_batch(cb, [m.ImageBatch.from_tensor(test_x)])
        cb.commit()
        cb.wait_until_completed()
        return probs.tensor.flatten(1)[:, : ex.CLASSES]

    infer.reload_from_data_sources()
    before = predict(infer)
    steps = 3
    for _ in range(steps):
        x = torch.randint(0, 256, (batch, 1, 28, 28), generator=gen, dtype=torch.uint8)
        y = torch.randint(0, ex.CLASSES, (batch,), generator=gen)
        onehot = (
            torch.nn.functional.one_hot(y, ex.LABEL_CHANNELS)
            .float()
            .view(-1, ex.LABEL_CHANNELS, 1, 1)
        )
        labels = m.StateBatch(m.LossLabels(dev, onehot[i]) for i in range(batch))
        cb = queue.command_buffer()
        train.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [labels])  # update() asserts t
        cb.commit()
        cb.wait_until_completed()
    for ds, (w0, b0) in zip(sources, params, strict=True):
        assert ds._t == steps and ds.adam.time_step == steps, ds.label
        assert ds.weights() is ds._weights and ds.bias_terms() is ds._biases
        for own, held in ((ds._weights, ds._state.weights), (ds._biases, ds._state.biases)):
            assert own.untyped_storage().data_ptr() == held.untyped_storage().data_ptr()
            assert own.data_ptr() == held.data_ptr() and torch.equal(own, held)
        assert not torch.equal(ds._weights, w0) and not torch.equal(ds._biases, b0), ds.label
    infer.reload_from_data_sources()
    after = predict(infer)
    fresh = [
        ex.AdamDataSource(dev, ds.weights().clone(), ds.bias_terms().clone(), ds.label)
        for ds in sources
    ]
    rebuilt = m.Graph(dev, ex.build_network(fresh, training=False).result_image, True)
    assert torch.equal(after, predict(rebuilt))
    assert not torch.equal(after, before)
