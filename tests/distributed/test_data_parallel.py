"""Data parallelism across processes (CPU, Gloo, 2 ranks): the same weights as one process on
the whole batch, the weight check, and a dead or hung rank ending the run with its name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mpsnn as m
from tests.distributed import _nets
from tests.distributed._helpers import spawn


@pytest.fixture(scope="module")
def equivalence_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("equivalence")
    ranks, _ = spawn("equivalence", out, deadline=90)
    for r, rank in enumerate(ranks):
        assert rank.code == 0, f"rank {r}: {rank.code}\n{rank.out}\n{rank.err}"
    return out


@pytest.mark.parametrize(("name", "bn", "optimizer", "dropout", "mib"), _nets.CASES)
def test_two_ranks_with_half_batches_equal_one_process_with_the_whole_batch(
    equivalence_run: Path, name: str, bn: bool, optimizer: str, dropout: bool, mib: float
) -> None:
    """Three steps of SGD (momentum) or Adam, with and without batch normalization (and
    dropout, whose masks follow the global image index), with one bucket per layer, one for
    the whole network, or a few: float64 graph and data sources, agreement to rounding."""
    graph, sources = _nets.build(bn, optimizer, dropout)
    _nets.train(graph)
    reference = _nets.values(sources)
    initial = _nets.values(_nets.build(bn, optimizer, dropout)[1])
    rank0 = torch.load(equivalence_run / f"{name}-rank0.pt")
    rank1 = torch.load(equivalence_run / f"{name}-rank1.pt")
    assert len(rank0) == len(reference) == len(rank1)
    for i, (a, b, ref, start) in enumerate(zip(rank0, rank1, reference, initial, strict=True)):
        assert torch.equal(a, b), f"{name}: value {i} differs between the ranks"
        scale = ref.norm().clamp_min(1e-300)
        assert (a - ref).norm() / scale < 1e-12, f"{name}: value {i} is not the whole batch's"
        if i == 0:
            assert (ref - start).norm() / scale > 1e-3, "the steps must move the weights"


@pytest.mark.parametrize("name", [case[0] for case in _nets.CASES])
def test_data_parallel_steps_run_from_a_step_program_equal_full_encodes(
    equivalence_run: Path, name: str
) -> None:
    """Each rank lowers its first step to a step program (collectives included) and runs the
    later steps from it: the weights equal, bit for bit, those of the same steps encoded in
    full every time (``reuse_step = False``, which lowers nothing)."""
    for r in (0, 1):
        uses, full_programs = (
            (equivalence_run / f"{name}-uses-rank{r}.txt").read_text().split(" ", 1)
        )
        assert int(uses) == _nets.STEPS - 1, uses
        assert full_programs == "[]"
        program = torch.load(equivalence_run / f"{name}-rank{r}.pt")
        full = torch.load(equivalence_run / f"{name}-full-rank{r}.pt")
        for i, (a, b) in enumerate(zip(program, full, strict=True)):
            assert torch.equal(a, b), f"{name} rank {r}: value {i} differs from full encodes"


@pytest.mark.parametrize("suffix", ["", "-full"], ids=["step program", "full encodes"])
def test_the_weight_check_names_the_rank_that_diverged(equivalence_run: Path, suffix: str) -> None:
    for r in (0, 1):
        message = (equivalence_run / f"diverge{suffix}-rank{r}.txt").read_text()
        assert message.startswith("[DataParallel] the weights diverged after step 2: rank 1 "
                                  "differs from rank 0"), message  # fmt: skip


def test_a_dead_rank_ends_the_other_with_its_name_within_the_timeout(tmp_path: Path) -> None:
    ranks, _ = spawn("die", tmp_path, timeout=10, deadline=40)
    assert ranks[1].code == 17
    assert ranks[0].code == 0, ranks[0].err
    waited, message = (tmp_path / "die-rank0.txt").read_text().split("\n", 1)
    assert "failed on rank 0: rank 1 stopped: no heartbeat for" in message, message
    assert float(waited) < 10


def test_a_hung_rank_ends_every_rank_after_the_timeout(tmp_path: Path) -> None:
    """Rank 1 sleeps (its heartbeat thread alive): both monitors see that it fell behind."""
    ranks, seconds = spawn("hang", tmp_path, timeout=3, deadline=40)
    for r, rank in enumerate(ranks):
        assert rank.code == 1, (r, rank.code, rank.err)
        assert f"mpsnn: [rank {r}] rank 1" in rank.err and "is behind" in rank.err, rank.err
    assert seconds < 20


def test_data_parallel_needs_a_process_group() -> None:
    with pytest.raises(ValueError, match=r"needs an initialized torch\.distributed process group"):
        m.DataParallel()


def test_the_host_work_of_a_replayed_step_counts_it_and_checks_the_weights(
    equivalence_run: Path,
) -> None:
    """`DataParallel.replayed` (what a compiled step calls after each replay): step 2 counted
    and checked equal; after rank 1's weights drift, the replay of the same step is checked
    again and names rank 1. Gloo collectives are not recorded (``capturable`` False)."""
    for r in (0, 1):
        head, message = (equivalence_run / f"replayed-rank{r}.txt").read_text().split("\n", 1)
        assert head == "capturable=False backend=gloo steps=2", head
        assert message.startswith("[DataParallel] the weights diverged after step 2: rank 1 "
                                  "differs from rank 0"), message  # fmt: skip


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="NCCL needs 2 GPUs"
)
def test_nccl_steps_replayed_with_their_collectives_equal_eager_steps(tmp_path: Path) -> None:
    """Two GPUs, NCCL: a compiled ResNet-18 data-parallel step (collectives recorded in its
    CUDA graph, the critical-path ones on the direct NCCL communicator) gives the eager steps'
    weights (collectives through torch.distributed) bit for bit at every step, and the periodic
    weight check runs after replays and names the rank that drifted."""
    ranks, _ = spawn("nccl_replay", tmp_path, deadline=300, timeout=120)
    for r, rank in enumerate(ranks):
        assert rank.code == 0, f"rank {r}: {rank.code}\n{rank.out}\n{rank.err[-3000:]}"
    for r in (0, 1):
        lines = (tmp_path / f"nccl-rank{r}.txt").read_text().splitlines()
        assert lines[0] == "eager_reason=None", lines
        assert lines[1:5] == [f"step {i} captured={i >= 2} same=True" for i in range(1, 5)], lines
        assert lines[5] == "replays=5 steps=6", lines
        assert lines[6].startswith("[DataParallel] the weights diverged after step 6: rank 1 "
                                   "differs from rank 0"), lines  # fmt: skip
        assert lines[7] == "direct=NcclComm other=False", lines


def test_local_batch_normalization_sums_the_shards_gradients(equivalence_run: Path) -> None:
    """``sync_batch_norm=False`` (PyTorch DDP's batch norm): each rank normalizes with its own
    shard's statistics, so one step's gradient is the sum of the two half-batch graphs'
    gradients (loss weight 1/B on each): after one SGD step from the same weights (the
    momentum is still zero), ``w = w_a + w_b - w0`` for weights, biases, gamma and beta. The
    running statistics are updated from the merged statistics of the whole batch: recovered
    here from each half's running update, merged with Chan's formula."""
    initial = _nets.values(_nets.build(True, "sgd")[1])
    halves = []
    for h in (0, 1):
        graph, sources = _nets.build(True, "sgd")
        _nets.train(graph, h, 2, steps=1)  # one process on half h, weight 1/BATCH
        halves.append(_nets.values(sources))
    rank0 = torch.load(equivalence_run / "localbn-rank0.pt")
    rank1 = torch.load(equivalence_run / "localbn-rank1.pt")
    # values: conv1 w, bn1 (gamma, beta, mean, var), conv2 w, bn2 (...), fc w, fc b
    running = {3: 256, 4: 256, 8: 64, 9: 64}  # index -> elements per channel of one half
    momentum = 0.1
    for i, (a, b, w0) in enumerate(zip(rank0, rank1, initial, strict=True)):
        assert torch.equal(a, b), f"value {i} differs between the ranks"
        h0, h1 = halves[0][i], halves[1][i]
        if i not in running:
            want = h0 + h1 - w0
        elif i in (3, 8):  # running mean: 0.9 * 0 + 0.1 * mean of the whole batch
            want = (h0 + h1) / 2
        else:  # running variance: 0.9 * 1 + 0.1 * unbiased variance of the whole batch
            nh = running[i]
            m0, m1 = (halves[0][i - 1] / momentum, halves[1][i - 1] / momentum)
            v0, v1 = ((h - (1 - momentum)) / momentum for h in (h0, h1))
            m2 = (v0 + v1) * (nh - 1) + (m1 - m0) ** 2 * nh / 2
            want = (1 - momentum) + momentum * m2 / (2 * nh - 1)
        scale = want.norm().clamp_min(1e-300)
        assert (a - want).norm() / scale < 1e-12, f"value {i}: {(a - want).norm() / scale}"
        if i in (0, 5):
            assert (a - h0).norm() / scale > 1e-6, "both shards must contribute"


def test_two_float32_ranks_with_ohwi_weights_equal_one_process(tmp_path: Path) -> None:
    """float32 data sources in OHWI memory: the fully connected layer's masters and weight
    gradient take that order on each rank (as the CPU's float32 convolutions'), and
    the all-reduce sums them element for element: the ranks agree bit for bit and equal one
    process on the whole batch to float32 rounding."""
    ranks, _ = spawn("float32_ohwi", tmp_path, deadline=90)
    for r, rank in enumerate(ranks):
        assert rank.code == 0, f"rank {r}: {rank.code}\n{rank.out}\n{rank.err}"
    graph, sources = _nets.build(False, "adam", dtype=torch.float32)
    _nets.train(graph)
    reference = _nets.values(sources)
    initial = _nets.values(_nets.build(False, "adam", dtype=torch.float32)[1])
    rank0 = torch.load(tmp_path / "float32-rank0.pt")
    rank1 = torch.load(tmp_path / "float32-rank1.pt")
    for r in (0, 1):  # the fully connected layer's masters (and the convolutions') in OHWI memory
        masters = (tmp_path / f"float32-ohwi-masters-rank{r}.txt").read_text().split()
        assert masters == ["Convolution", "FullyConnected"]
    assert len(rank0) == len(reference) == len(rank1)
    for i, (a, b, ref, start) in enumerate(zip(rank0, rank1, reference, initial, strict=True)):
        assert a.dtype == torch.float32
        assert torch.equal(a, b), f"value {i} differs between the ranks"
        scale = ref.norm().clamp_min(1e-30)
        assert (a - ref).norm() / scale < 1e-5, f"value {i} is not the whole batch's"
        assert (ref - start).norm() / scale > 1e-4, "the steps must move the weights"
