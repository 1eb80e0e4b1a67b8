"""`mpsnn.core.grouped`: a grouped reload's read counts and the order of its copies."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from mpsnn.core.grouped import _ordered, check_grouped_reads, pair_copier


def test_copies_go_pair_by_pair_only_where_their_order_matters() -> None:
    a, b, c = torch.zeros(3), torch.zeros(3), torch.ones(3)
    assert not _ordered([a, b], [c, c.clone()])  # independent: one multi-tensor copy
    assert _ordered([a, a], [c, c])  # a destination twice
    assert _ordered([a, b], [c, a])  # a source that is a destination
    assert _ordered([a, b], [c, a[1:]])  # ... or a view of one
    whole = torch.zeros(6)
    assert _ordered([whole[:3], whole[3:]], [c, c])  # one storage: conservatively in order
    assert pair_copier([a, b], [c, c]).__name__ == "<lambda>"
    assert pair_copier([a, b], [c, a]).__name__ == "in_order"


def test_in_order_copies_give_the_sequential_result() -> None:
    a, b = torch.zeros(2), torch.zeros(2)
    new, later = torch.tensor([1.0, 2.0]), torch.tensor([5.0, 6.0])
    pair_copier([a, b, a], [new, a, later])()
    assert torch.equal(b, new) and torch.equal(a, later)


def test_a_temporary_state_read_more_often_than_its_count_raises() -> None:
    dev = m.Device("cpu")
    cb = dev.new_command_queue().command_buffer()
    st = m.NormalizationGammaAndBetaState(torch.ones(2), torch.zeros(2), command_buffer=cb)
    permanent = m.NormalizationGammaAndBetaState(torch.ones(2), torch.zeros(2))
    check_grouped_reads([("K", st), ("K", permanent), ("K", permanent)])  # permanents: any
    with pytest.raises(m.StaleResourceError, match=r"\[K2\] .* at least its 2 reads .* got 1"):
        check_grouped_reads([("K1", st), ("K2", st)])
    st.read_count = 2
    check_grouped_reads([("K1", st), ("K2", st)])
