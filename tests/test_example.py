"""The README's main job: the Fashion-MNIST example trains (a short run, every gradient kernel of
the network in the loop) and reaches a non-trivial test accuracy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

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
