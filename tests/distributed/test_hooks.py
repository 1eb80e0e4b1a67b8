"""The graph's data-parallel hooks (``graph.data_parallel``): when each is called, what it
sees, and that a graph without them behaves as before (one process, no process group)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mpsnn as m
from tests.distributed import _nets


class _Recorder:
    """A hook object that records its calls, and the command each call follows."""

    capturable = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def begin_step(self, step: Any) -> _Recorder:
        self.cb = step.cb
        self.calls.append(("begin", ""))
        return self

    def _last(self) -> str:
        return self.cb._commands[-1].name if self.cb._commands else ""

    def weight_gradient_ready(self, node: Any, kernel: Any, states: Any) -> None:
        self.calls.append(("gradient", type(node).__name__))

    def batch_norm_statistics(self, node: Any, state: Any) -> None:
        assert isinstance(state, m.BatchNormalizationState)
        self.calls.append(("bn statistics", self._last()))

    def batch_norm_gradient_sums(self, node: Any, state: Any) -> None:
        self.calls.append(("bn sums", self._last()))

    def before_updates(self) -> None:
        self.calls.append(("before updates", ""))

    def after_updates(self) -> None:
        self.calls.append(("after updates", ""))


def test_the_hooks_are_called_in_step_order() -> None:
    graph, _ = _nets.build(bn=True, optimizer="sgd")
    hooks = _Recorder()
    graph.data_parallel = hooks
    _nets.train(graph, steps=1)
    kinds = [k for k, _ in hooks.calls]
    assert kinds == [
        "begin", "bn statistics", "bn statistics",
        "gradient",  # the fully connected layer, first in backward order
        "bn sums", "gradient", "gradient",  # the second batch norm, then its convolution
        "bn sums", "gradient", "gradient",
        "before updates", "after updates",
    ]  # fmt: skip
    stats = [after for k, after in hooks.calls if k == "bn statistics"]
    sums = [after for k, after in hooks.calls if k == "bn sums"]
    assert all("BatchNormalizationStatistics" in name for name in stats), stats
    assert all("BatchNormalizationStatisticsGradient" in name for name in sums), sums
    grads = [name for k, name in hooks.calls if k == "gradient"]
    assert grads[0] == "FullyConnectedGradientNode"
    assert grads.count("BatchNormalizationGradientNode") == 2


def test_a_graph_with_hooks_equals_one_without() -> None:
    """Hooks that record no work leave the step as it was; a compiled step runs eagerly."""
    a, sa = _nets.build(bn=True, optimizer="adam", dropout=True)
    b, sb = _nets.build(bn=True, optimizer="adam", dropout=True)
    b.data_parallel = _Recorder()
    _nets.train(a)
    compiled = b.compile()
    for step in range(_nets.STEPS):
        x, y = _nets.batch(step)
        compiled([m.ImageBatch.from_tensor(x)], [m.LossLabels(_nets.DEV, y.view(-1, 1, 1))])
        compiled.wait_until_completed()
    assert not compiled.is_captured
    for u, v in zip(_nets.values(sa), _nets.values(sb), strict=True):
        assert torch.equal(u, v)


def test_data_parallel_on_one_rank_is_one_process(one_rank: None) -> None:
    a, sa = _nets.build(bn=True, optimizer="sgd", dropout=True)
    b, sb = _nets.build(bn=True, optimizer="sgd", dropout=True)
    dp = m.DataParallel(check_every=1)
    b.data_parallel = dp
    _nets.train(a)
    _nets.train(b)
    assert (dp.rank, dp.world_size, dp.steps) == (0, 1, _nets.STEPS)
    assert "rank 0/1" in repr(dp)
    for u, v in zip(_nets.values(sa), _nets.values(sb), strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bucket_mib": -1}, ValueError, "bucket_mib must be a finite number >= 0, got -1"),
        ({"bucket_mib": "25"}, TypeError, "bucket_mib must be a number, got str"),
        ({"check_every": -2}, ValueError, "check_every must be >= 0, got -2"),
        ({"check_every": 1.5}, TypeError, "check_every must be an int, got float"),
    ],
)
def test_data_parallel_arguments(
    one_rank: None, kwargs: dict[str, Any], error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        m.DataParallel(**kwargs)
