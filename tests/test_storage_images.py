"""A bfloat16 or float16 training run is given its images in that format (as PyTorch's
autocast casts a convolution's input), so its first layer computes in the graph's format and
not in the images' float32; float32 and float64 runs get their images as they are."""

from __future__ import annotations

import torch

import mpsnn as m
from mpsnn.cli.bench import _batch
from mpsnn.training.loop import storage_images

F = m.FeatureChannelFormat


def test_narrow_storage_gets_its_own_dtype() -> None:
    x = torch.randn(2, 1, 4, 4)
    for fmt, dtype in ((F.BFLOAT16, torch.bfloat16), (F.FLOAT16, torch.float16)):
        got = storage_images(x, fmt)
        assert got.dtype is dtype and torch.equal(got, x.to(dtype))
        assert _batch(x, fmt).image.tensor.dtype is dtype
    for fmt in (None, F.FLOAT32, F.FLOAT64):
        assert storage_images(x, fmt) is x
    assert storage_images(x.double(), F.BFLOAT16).dtype is torch.float64  # not narrowed


def test_the_first_convolution_of_a_bfloat16_step_reads_bfloat16(monkeypatch) -> None:
    """The images the training loop hands its graph are bfloat16."""
    from mpsnn.training import loop

    seen = []
    real = loop.Image.from_tensor

    def spy(t, *args, **kwargs):
        seen.append(t.dtype)
        return real(t, *args, **kwargs)

    monkeypatch.setattr(loop.Image, "from_tensor", spy)
    from mpsnn.cli.common import build_model

    dev = m.Device("cpu")
    net = build_model("lenet", dev, m.Adam(dev, learning_rate=1e-3), seed=0)
    step = loop.TrainingLoop(net, 4, storage=F.BFLOAT16)
    sums = step.new_sums()
    step.train_step(torch.randn(4, 1, 28, 28), torch.tensor([0, 1, 2, 3]), sums)
    assert seen == [torch.bfloat16]
