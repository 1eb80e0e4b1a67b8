"""The Triton max-pooling gradient equals the portable path, bit for bit: ties, NaNs, windows
that do not tile the image, every storage format. On the CPU it runs in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.pooling import max_pool_backward_portable, pool_geometry
from mpsnn.ops.triton import pooling as triton_pooling  # the dev setup installs Triton
from tests.helpers import TRITON_DEVICES

SHAPES = [
    # (N, C, H, W, k, y0, x0, OH, OW)
    (2, 3, 8, 8, 2, 0, 0, 4, 4),  # tiles the image
    (1, 2, 9, 7, 3, 0, 1, 3, 2),  # leftover rows and columns get 0
    (2, 2, 6, 6, 2, 1, 0, 2, 3),
    (1, 2, 8, 12, 4, 0, 0, 2, 3),
    (1, 1, 5, 33, 1, 0, 0, 5, 33),  # 1x1 windows
    (1, 2, 4, 301, 2, 0, 1, 2, 150),  # 2-wide windows over two column blocks, offset by one
]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_max_pool_gradient_equals_portable(shape, dtype, device) -> None:
    n, c, h, w, k, y0, x0, oh, ow = shape
    gen = torch.Generator().manual_seed(81)
    x = torch.randint(-2, 3, (n, c, h, w), generator=gen).float()  # many ties
    x.view(-1)[::7] = float("nan")
    x.view(-1)[3::11] = -float("inf")
    x = x.to(device=device, dtype=dtype)
    g = torch.randn(n, c, oh, ow, generator=gen).to(device=device, dtype=dtype)
    geom = pool_geometry(
        AxisWindow(y0, oh, k, k, 1, h), AxisWindow(x0, ow, k, k, 1, w), EdgeMode.ZERO
    )
    assert fast_paths.pool_tiles(geom)
    got = triton_pooling.max_pool_backward_triton(g, x, geom)
    want = max_pool_backward_portable(g, x, geom)
    assert got.dtype == dtype and torch.equal(got, want)


def test_dispatch_picks_triton_only_where_it_applies() -> None:
    geom = pool_geometry(AxisWindow(0, 2, 2, 2, 1, 4), AxisWindow(0, 2, 2, 2, 1, 4), EdgeMode.ZERO)
    overlap = pool_geometry(
        AxisWindow(0, 3, 2, 1, 1, 4), AxisWindow(0, 3, 2, 1, 1, 4), EdgeMode.ZERO
    )
    cpu = torch.zeros(1, 1, 4, 4)
    assert fast_paths.pool_tiles(geom) and not fast_paths.pool_tiles(overlap)
    assert fast_paths.max_pool_backward(cpu[..., :2, :2], cpu, geom) is None  # CPU tensors
    if torch.cuda.is_available():
        gpu = cpu.cuda()
        assert fast_paths.max_pool_backward(gpu[..., :2, :2], gpu, geom) is not None
        assert fast_paths.max_pool_backward(gpu[..., :3, :3], gpu, overlap) is None
        fast_paths.set_enabled(False)
        try:
            assert fast_paths.max_pool_backward(gpu[..., :2, :2], gpu, geom) is None
        finally:
            fast_paths.set_enabled(True)
