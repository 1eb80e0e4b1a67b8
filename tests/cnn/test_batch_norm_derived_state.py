"""A batch-normalization state's variance is written by the work that changes its sums (each
statistics run after merging its sub-batch, a data-parallel exchange of statistics), as part of
that work; the kernels that read it only read. No host-side cache keyed on tensor versions or
replay counts remains in the normalization code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.distributed.collectives import _StepCollectives
from mpsnn.ops.batch_norm import bn_statistics, bn_variance
from tests.helpers import assert_close, run

DEV = m.Device("cpu")
EPS = 1e-5


def _data(n: int, c: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, 4, 5, generator=gen, dtype=torch.float64) * 2 + 0.5
    gamma = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5
    beta = torch.randn(c, generator=gen, dtype=torch.float64)
    return x, gamma, beta


def _kernels(c: int, gamma: torch.Tensor, beta: torch.Tensor) -> tuple:
    ds = m.TensorBatchNormalizationDataSource(c, gamma, beta, epsilon=EPS)
    return m.BatchNormalizationStatistics(DEV), m.BatchNormalization(DEV, ds)


def _biased(x: torch.Tensor) -> torch.Tensor:
    return x.var((0, 2, 3), unbiased=False)


def _exactly_derived(state: m.BatchNormalizationState) -> bool:
    """The variance storage holds ``bn_variance`` of the sums, bit for bit."""
    count, _, m2 = state._slots[0]
    return torch.equal(state._var, bn_variance(count, m2))


def _state_with_statistics(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> tuple:
    """``(statistics kernel, bn, src, state, queue)``: a state whose statistics of ``x``
    ran."""
    stats, bn = _kernels(3, gamma, beta)
    src = m.ImageBatch.from_tensor(x)
    state = bn.result_state(src[0])
    q = DEV.new_command_queue()
    cb = q.command_buffer()
    stats.encode_batch(cb, src, state)
    run(cb)
    return stats, bn, src, state, q


# -- the statistics write it ------------------------------------------------------------------


def test_each_statistics_run_writes_the_variance_of_the_sums_merged_so_far() -> None:
    """Three sub-batches, one command buffer each, and nothing that reads the state between
    them: after each, the storage ``state.variance`` returned at encode time holds the biased
    variance of the images merged so far."""
    x, gamma, beta = _data(6)
    stats, bn = _kernels(3, gamma, beta)
    parts = x.chunk(3)
    state = bn.result_state(m.ImageBatch.from_tensor(parts[0])[0])
    q = DEV.new_command_queue()
    storage = None
    for k, part in enumerate(parts):
        cb = q.command_buffer()
        stats.encode_batch(cb, m.ImageBatch.from_tensor(part), state)
        if storage is None:
            storage = state.variance  # stable storage: the statistics write into it
        run(cb)
        assert state.variance is storage
        assert_close(storage, _biased(x[: 2 * (k + 1)]), f"variance after sub-batch {k}")
        assert _exactly_derived(state), f"sub-batch {k}: not m2 / count of the sums"


def test_a_reset_then_new_statistics_rewrite_the_same_storage() -> None:
    x, gamma, beta = _data(4, seed=1)
    stats, _, _, state, q = _state_with_statistics(x, gamma, beta)
    storage = state.variance
    state.reset()
    cb = q.command_buffer()
    stats.encode_batch(cb, m.ImageBatch.from_tensor(3 * x[:2]), state)  # stored, not merged
    run(cb)
    assert state.variance is storage
    assert_close(storage, _biased(3 * x[:2]), "variance of the new batch")
    assert _exactly_derived(state)


def test_readers_only_read_the_variance() -> None:
    """The forward and both gradient kernels read the variance the statistics wrote and never
    write it: a change of ``m2`` made outside the statistics (which does not follow the
    contract of rewriting the variance) leaves the variance, and what the kernels compute, as
    the statistics left them."""
    x, gamma, beta = _data(4, seed=2)
    _, bn, src, state, q = _state_with_statistics(x, gamma, beta)
    var = state.variance
    written, version = var.clone(), var._version
    state._slots[0][2].mul_(4.0)  # not through a statistics command
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    gb = m.ImageBatch.from_tensor(g)
    cb = q.command_buffer()
    y = bn.encode_batch(cb, src, state)
    m.BatchNormalizationStatisticsGradient(DEV).encode_batch(cb, gb, src, state)
    m.BatchNormalizationGradient(DEV).encode_batch(cb, gb, src, state)
    run(cb)
    assert state.variance is var and var._version == version and torch.equal(var, written)
    want = F.batch_norm(x, x.mean((0, 2, 3)), written, gamma, beta, training=False, eps=EPS)
    assert_close(y.tensor, want, "forward on the written variance")


# -- a data-parallel exchange writes it -------------------------------------------------------


def _exchange(sync: bool, seed: int) -> None:
    """Rank 0 of two: the other rank's statistics are those of ``x1``. The step encodes the
    statistics of ``x0`` and the exchange only (no kernel reads the state): the variance the
    exchange leaves is the whole batch's."""
    x, gamma, beta = _data(6, seed=seed)
    x0, x1 = x[:4], x[4:]
    count, mean, m2 = bn_statistics(x1)
    counts = count if sync else count.expand(3)  # the local merge packs a count per channel
    other = torch.cat([counts.to(mean.dtype), mean, m2])

    def all_gather(what: str, packed: torch.Tensor) -> torch.Tensor:
        return torch.stack([packed, other.to(packed.dtype)])

    dp = SimpleNamespace(world_size=2, sync_batch_norm=sync, _all_gather=all_gather)
    stats, bn = _kernels(3, gamma, beta)
    src = m.ImageBatch.from_tensor(x0)
    state = bn.result_state(src[0])
    cb = DEV.new_command_queue().command_buffer()
    hooks = _StepCollectives(dp, SimpleNamespace(cb=cb))
    stats.encode_batch(cb, src, state)
    storage = state.variance
    hooks.batch_norm_statistics(None, state)
    if not sync:
        hooks.before_updates()  # local statistics: merged after the backward
    run(cb)
    assert state.variance is storage
    assert_close(storage, _biased(x), "variance after the exchange")
    assert _exactly_derived(state)


def test_a_synchronized_exchange_writes_the_variance_of_the_whole_batch() -> None:
    _exchange(sync=True, seed=4)


def test_a_local_merge_after_the_backward_writes_the_variance_of_the_whole_batch() -> None:
    _exchange(sync=False, seed=5)


# -- nothing keyed on versions or replays -----------------------------------------------------

ROOT = Path(m.__file__).resolve().parent
NORMALIZATION_CODE = [
    *sorted((ROOT / "cnn" / "normalization").glob("*.py")),
    *sorted((ROOT / "ops").glob("batch_norm*.py")),
    *sorted((ROOT / "ops" / "triton").glob("batch_norm*.py")),
]


def test_the_replay_counter_module_is_gone() -> None:
    assert importlib.util.find_spec("mpsnn.core.replays") is None
    for path in (ROOT / "core" / "device.py", ROOT / "core" / "capture.py"):
        assert not re.search(r"\bcore\.replays\b|\bimport replays\b|\b_replays\b", path.read_text())


def test_no_normalization_code_keys_anything_on_versions_or_addresses() -> None:
    assert len(NORMALIZATION_CODE) >= 9
    found = [
        f"{path.relative_to(ROOT)}: {hit}"
        for path in NORMALIZATION_CODE
        for hit in re.findall(r"_version\b|data_ptr|replays|\w*memo(?!ry)\w*", path.read_text())
        if hit != "memo"  # the kernels' per-encode planning memo (a dict of extract plans)
    ]
    assert not found, found


def test_a_state_keeps_no_version_keyed_attribute_after_a_step() -> None:
    x, gamma, beta = _data(4, seed=6)
    stats, bn = _kernels(3, gamma, beta)
    src = m.ImageBatch.from_tensor(x)
    state = bn.result_state(src[0])
    cb = DEV.new_command_queue().command_buffer()
    stats.encode_batch(cb, src, state)
    bn.encode_batch(cb, src, state)
    run(cb)
    names = [n for n in vars(state) if re.search("memo|version|epoch", n)]
    assert not names, names
