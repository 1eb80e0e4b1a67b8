"""The collectives of a synchronized batch normalization run in place on the buffer its
kernels wrote a layer's vectors into (`_adjacent`), and copy the vectors otherwise."""

from __future__ import annotations

import torch

from mpsnn.distributed.data_parallel import _adjacent


def test_pieces_of_one_buffer_in_order_give_one_view_of_it() -> None:
    out = torch.arange(7.0)
    count, mean, m2 = out[:1], out[1:4], out[4:7]
    whole = _adjacent([count, mean, m2])
    assert whole is not None and torch.equal(whole, out)
    whole.mul_(2)  # a collective's in-place result lands in the pieces
    assert torch.equal(mean, torch.tensor([2.0, 4.0, 6.0]))
    # the gradient sums' rows, listed in reverse: in any order only when asked
    sums = torch.arange(6.0).view(2, 3)
    assert _adjacent([sums[1], sums[0]]) is None
    flat = _adjacent([sums[1], sums[0]], ordered=False)
    assert flat is not None and flat.data_ptr() == sums.data_ptr() and flat.numel() == 6


def test_anything_else_is_refused() -> None:
    out = torch.arange(8.0)
    assert _adjacent([out[:2], out[3:5]]) is None  # a gap
    assert _adjacent([out[:2], out[1:3]]) is None  # an overlap
    assert _adjacent([torch.zeros(2), torch.zeros(3)]) is None  # two storages
    assert _adjacent([out[:2], out.view(2, 4)[:, 2]]) is None  # not contiguous
    mixed = torch.zeros(4, dtype=torch.float32)
    assert _adjacent([mixed[:2], mixed[2:].view(torch.int32)]) is None  # two dtypes
