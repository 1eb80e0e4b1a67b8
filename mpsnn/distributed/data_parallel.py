"""`DataParallel`: a training `Graph` run by every rank of a ``torch.distributed`` process
group on its shard of the global batch, giving the weights one process would get on the whole
batch (up to rounding).

Let the global batch of ``B`` images be split into ``W`` shards of ``B / W`` images, rank ``r``
encoding shard ``r`` with the loss weight ``1 / B`` (``model.training_graph(B)``). The graph
calls the hooks of `StepCollectives` (``mpsnn.graph.step``; `mpsnn.distributed.collectives`
implements them) at four places of its step; each records its collective as a command
(``cb.record``), so it runs in command order:

* **batch-normalization statistics** (after the statistics kernel, before the normalization):
  every rank's per-channel triple ``(count, mean, m2)`` is all-gathered and merged with the
  closed form of Chan's pairwise update (`mpsnn.ops.batch_norm.bn_merge_rows`: one Triton
  kernel in float64 on CUDA, `mpsnn.ops.batch_norm.bn_merge_all` elsewhere)::

      n = Σ n_r,   mean = Σ n_r mean_r / n,   m2 = Σ m2_r + Σ n_r (mean_r - mean)²

  so every rank normalizes with the global batch's mean and biased variance ``m2 / n`` (which
  the exchange writes into the state with the sums), and updates its running statistics
  identically;
* **batch-normalization gradient sums** (after the statistics gradient, before the input
  gradient): ``[Σ gy·xhat, Σ gy]`` are all-reduced (summed): the input gradient
  ``dx = gamma / sqrt(var + eps) (gy - Σgy / n - xhat Σgy·xhat / n)`` then uses the global
  sums and count, and so do the gamma/beta updates. The input gradient waits for this
  collective; so that the device has work meanwhile, in a captured step the weight gradient
  of the convolution before it in backward order (which nothing in between reads) runs on the
  queue's side stream, beside the statistics gradient and the collective
  (``weights_beside``; the same bits);
* **weight gradients** (each trainable layer's gradient node, in backward order): the layer's
  gradient sums (``dL/dW``, ``dL/db``; gamma/beta of instance and group normalization) join a
  **bucket**; for a bucket of ``bucket_mib`` MiB or more, one asynchronous collective (sum)
  is launched right after the gradient node that filled it: the sums all-reduced in place, as
  one coalesced group (flattened into one tensor and copied back instead where a sum is not
  contiguous, or with Gloo on CUDA tensors). It overlaps the gradients that follow (on CUDA
  the collective runs on NCCL's stream while the queue's stream computes; on the CPU in Gloo's
  threads). With per-image losses weighted ``1 / B``, ``Σ_r Σ_{i ∈ shard r} dL_i/dW = dL/dW``
  of the global batch;
* **before the updates**: the last bucket is launched, every bucket waited for (CUDA: a stream
  dependency, no host wait; a flattened bucket's sums copied back into the gradient states);
  the data sources' updates then read the global gradients, so every rank applies the same
  update.

**Which communicator** (CUDA, NCCL backend): the collectives that the next kernel waits for —
the statistics all-gathers, the gradient-sum all-reduces and the weight check — run on a NCCL
communicator of mpsnn's own (`mpsnn.distributed.nccl.NcclComm`, made by every rank at the first
such collective outside a CUDA graph capture), launched on the queue's stream with no event or
work object around them: less host time and latency than a process-group call, the same
values. The buckets keep the process group's asynchronous all-reduces, which overlap the
backward. By default only where a `RankMonitor` watches the ranks (it ends a rank stuck in
such a collective; the process group's timeout does not); ``direct_nccl=False``, or a rank
without a usable NCCL library, keeps every collective on the process group.

A collective that fails raises `DistributedError` from its command (``cb.error``, re-raised by
``wait_until_completed``), naming the rank that died or hung where the rank's `RankMonitor`
tells; later commands of the step do not run.

Every ``check_every`` steps (0: never) the weights of the step's layers (master weights and
biases, gamma/beta, running statistics) are summarized per tensor by ``(Σw, Σw²)`` in float64,
all-gathered and compared bit for bit: the ranks apply identical updates to identical weights,
so any difference is a divergence, and `DistributedError` names the ranks that differ from the
majority (ties: from rank 0's group).

Dropout kernels of the graph draw the masks of the global batch's images: rank ``r`` sets
``image_offset = r · B / W`` at each step.

**Local batch normalization** (``sync_batch_norm=False``, what PyTorch's
``DistributedDataParallel`` does without ``SyncBatchNorm``): each rank normalizes its shard
with the shard's own statistics and differentiates that, so no collective sits between a
normalization's statistics and its output (two small collectives per layer and step fewer on
the critical path). The gamma/beta gradient sums join the weight-gradient buckets, so every
rank applies the same update: the sum over the shards of their gradients. After the backward
the statistics of every layer are gathered in **one** all-gather and merged as above, and the
running statistics are updated from the merged ones: identical on every rank (so the weight
check still holds), the whole batch's. The weights are then not one process's on the whole
batch (the normalization differs), but those of the shards' summed gradients.

**Eager steps** run the graph's step program (`mpsnn.graph.program`, ``programmable``): the
first encode of an input layout calls the hooks above and its commands, collectives included,
become the program; later encodes append that list. The host work of a step (count, progress
mark, weight check when due) is `DataParallel.program_step`, which every such encode calls.

**Replayed steps** (`Graph.compile` on CUDA with the NCCL backend: ``capturable``). Every
collective above is recorded in the step's CUDA graph: NCCL launches captured on the queue's
stream (the process group's stream joins the capture through events), so a replay runs the
whole step, collectives included, with one launch and no host work — each rank replays its own
recording of the same sequence of collectives, which NCCL requires. What is host work is done
around the replays instead: `DataParallel.replayed` counts the step, marks the monitor's
progress and runs the weight check when one is due (outside the recording; its comparison needs
the host). A collective that fails inside a replay cannot raise from its command (nothing runs
on the host then): the `RankMonitor` ends a rank whose peer died or hung within its timeout,
naming the peer. With Gloo (CPU) nothing is captured: ``capturable`` is False and compiled
steps run eagerly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mpsnn.cnn.dropout import Dropout
from mpsnn.distributed.collectives import _StepCollectives
from mpsnn.distributed.nccl import NcclComm
from mpsnn.distributed.runtime import current_monitor
from mpsnn.errors import DistributedError

__all__ = ["DataParallel"]

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Several all-reduces as one collective: what DistributedDataParallel's buckets avoid copying
# for (PyTorch's own context manager; private, present since torch 2.1)
_coalescing = dist.distributed_c10d._coalescing_manager


class DataParallel:
    """The data-parallel hooks of a training graph (see the module docstring):
    ``graph.data_parallel = DataParallel()``.

    Args:
        process_group: the ranks that share the training (None: the default group, which must
            be initialized: `mpsnn.init_distributed` or ``torch.distributed.init_process_group``).
        bucket_mib: the size in MiB from which a bucket of weight gradients is all-reduced
            (the last one may be smaller). 0 all-reduces each layer on its own.
        check_every: compare the ranks' weights every this many steps (0: never).
        monitor: the `RankMonitor` that names failed ranks (None: the one `init_distributed`
            started, if any).
        sync_batch_norm: True: batch normalization normalizes with the global batch's
            statistics (the weights one process would get). False: with this rank's own, as
            PyTorch's ``DistributedDataParallel`` does without ``SyncBatchNorm`` (no collective
            on the critical path of a normalization; see "local batch normalization" in the
            module docstring).
        direct_nccl: with the NCCL backend, run the collectives that the next kernel waits
            for (statistics all-gathers, gradient-sum all-reduces, the weight check) on a NCCL
            communicator of mpsnn's own, on the queue's stream (`mpsnn.distributed.nccl`:
            less host time and latency than a process-group call; the same values). None
            (the default): where a `RankMonitor` watches the rank (`mpsnn.init_distributed`,
            ``mpsnn train --nproc``), which is what ends a rank stuck in such a collective
            (the process group's timeout does not watch them). True: with or without one.
            False: always ``torch.distributed``. Made at the first such collective that runs
            outside a CUDA graph capture, by every rank; unless every rank wants it and can
            make it (a usable NCCL library), every rank keeps ``torch.distributed``.

    Attributes:
        rank, world_size: this process in the group.
        backend: the process group's backend (``"nccl"``, ``"gloo"``).
        steps: training steps run so far (encoded, or replayed).
    """

    def __init__(
        self,
        process_group: Any = None,
        *,
        bucket_mib: float = 25.0,
        check_every: int = 0,
        monitor: Any = None,
        sync_batch_norm: bool = True,
        direct_nccl: bool | None = None,
    ) -> None:
        who = "DataParallel"
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                f"[{who}] needs an initialized torch.distributed process group "
                "(mpsnn.init_distributed() or torch.distributed.init_process_group()), got none"
            )
        if isinstance(bucket_mib, bool) or not isinstance(bucket_mib, int | float):
            raise TypeError(f"[{who}] bucket_mib must be a number, got {type(bucket_mib).__name__}")
        if not (math.isfinite(bucket_mib) and bucket_mib >= 0):
            raise ValueError(f"[{who}] bucket_mib must be a finite number >= 0, got {bucket_mib}")
        if isinstance(check_every, bool) or not isinstance(check_every, int):
            raise TypeError(f"[{who}] check_every must be an int, got {type(check_every).__name__}")
        if check_every < 0:
            raise ValueError(f"[{who}] check_every must be >= 0, got {check_every}")
        if not isinstance(sync_batch_norm, bool):
            raise TypeError(
                f"[{who}] sync_batch_norm must be a bool, got {type(sync_batch_norm).__name__}"
            )
        if direct_nccl is not None and not isinstance(direct_nccl, bool):
            raise TypeError(
                f"[{who}] direct_nccl must be a bool or None, got {type(direct_nccl).__name__}"
            )
        self.sync_batch_norm = sync_batch_norm
        self.direct_nccl = direct_nccl
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.bucket_bytes = int(bucket_mib * 2**20)
        self.check_every = check_every
        self.monitor = monitor
        self.backend = str(dist.get_backend(process_group)).lower()
        self.steps = 0
        self._named: list[tuple[str, torch.Tensor]] | None = None  # the last step's weights
        # the direct communicator: None until decided, False when every rank keeps
        # torch.distributed (`_comm`)
        self._direct: NcclComm | bool | None = None if direct_nccl is not False else False

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph may record this graph's steps, collectives included (the NCCL
        backend, or a group of one rank: no collectives). ``Graph.compile`` runs the steps of
        a graph whose hooks are not capturable eagerly."""
        return self.world_size == 1 or self.backend == "nccl"

    @property
    def programmable(self) -> bool:
        """A graph may lower its steps to a step program (`mpsnn.graph.program`): the
        collectives are commands of the program like the others, and the step's host work
        (count, progress mark, weight check) is done by `program_step` at each encode."""
        return True

    def program_settings(self) -> tuple[Any, ...]:
        """What a lowered step's collectives were made from: a change lowers again."""
        return (self.process_group, self.rank, self.world_size, self.sync_batch_norm,
                self.bucket_bytes, self.check_every, self.direct_nccl)  # fmt: skip

    def program_step(self, command_buffer: Any) -> None:
        """The host work of one encode that runs (or lowers) a step program: count the step,
        mark progress, and record the weight check when one is due (after the step's
        updates, before its outputs are handed over)."""
        self._mark()
        self._count_step(command_buffer)

    def _count_step(self, command_buffer: Any) -> None:
        """Count an encoded step and record the weight check on ``command_buffer`` when one is
        due (the step's last work, after its updates)."""
        self.steps += 1
        named, every, step_number = self._named, self.check_every, self.steps
        if named is None or not every or self.world_size == 1 or step_number % every:
            return

        def check() -> None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return  # recorded for replays: `DataParallel.replayed` checks them
            self._check(named, step_number)

        command_buffer.record(f"weight check of step {step_number}", check)

    def replayed(self, new_step: bool = True) -> None:
        """The host work of one replay of a recorded step (`CompiledGraph` calls it after
        the replay, on the queue's stream): count the step (``new_step`` False for the replay
        that runs the recorded step itself, counted when it was encoded), mark progress, and
        check the weights when a check is due."""
        if new_step:
            self.steps += 1
        self._mark()
        if self._named is not None and self.check_every and self.steps % self.check_every == 0:
            self._check(self._named, self.steps)

    def _check(self, named: list[tuple[str, torch.Tensor]], step_number: int) -> None:
        """Compare the ranks' weights bit for bit (`DistributedError` names who differs)."""
        parts = [torch.stack([t.double().sum(), t.double().square().sum()])
                 for _, t in named]  # fmt: skip
        local = torch.cat(parts) if parts else torch.zeros(2, dtype=torch.float64)
        rows = self._all_gather(f"the weight check of step {step_number}", local).cpu()
        _compare(rows, [name for name, _ in named], step_number, self.rank)

    def begin_step(self, step: Any) -> _StepCollectives:
        """The graph's hook: the collectives of one ``encode_batch`` (``step``: its `_Step`)."""
        for kernel in step.graph._plan.kernels.values():
            for k in kernel if isinstance(kernel, tuple) else (kernel,):
                if isinstance(k, Dropout):
                    k.image_offset = self.rank * step.n  # equal shards: the global image index
        self._mark()
        return _StepCollectives(self, step)

    def _mark(self) -> None:
        """A progress mark for the monitor (a step begun, a collective entered): a rank that
        hangs is the one whose marks fall behind."""
        monitor = self.monitor or current_monitor()
        if monitor is not None:
            monitor.progress()

    # -- collectives with failures explained ----------------------------------------------------

    def _collective(self, what: str, fn: Callable[[], Any]) -> Any:
        self._mark()
        try:
            return fn()
        except DistributedError:
            raise
        except Exception as exc:
            monitor = self.monitor or current_monitor()
            if monitor is not None:
                why = monitor.diagnose()
            else:
                text = str(exc).strip()
                why = text.splitlines()[0] if text else type(exc).__name__
            raise DistributedError(
                f"[DataParallel] {what} failed on rank {self.rank}: {why}"[:600]
            ) from exc

    def _all_reduce(self, what: str, flat: torch.Tensor) -> Any:
        """Sum ``flat`` over the ranks in place, asynchronously (on NCCL's stream with that
        backend); returns what to ``wait()`` for."""
        group = self.process_group
        return self._collective(what, lambda: dist.all_reduce(flat, group=group, async_op=True))

    def _sum_now(self, what: str, flat: torch.Tensor) -> None:
        """Sum ``flat`` over the ranks in place, before the work launched after this call
        (the direct communicator where there is one: `_comm`)."""
        comm = self._comm(flat)
        if comm is not None:
            self._collective(what, lambda: comm.all_reduce_(flat))
            return
        work = self._all_reduce(what, flat)
        self._collective(what, work.wait)

    def _comm(self, t: torch.Tensor) -> NcclComm | None:
        """The direct communicator for a collective of CUDA ``t`` (made on first use: every
        rank reaches the same collectives in the same order, so every rank decides at the same
        one), or None: ``torch.distributed`` then. Not made during a CUDA graph capture
        (NCCL's initialization cannot be recorded): that collective takes the process group's
        path, and a later one outside the capture decides."""
        direct = self._direct
        if direct is False or not t.is_cuda:
            return None
        if direct is None:
            if self.backend != "nccl" or self.world_size == 1:
                self._direct = False
                return None
            if torch.cuda.is_current_stream_capturing():
                return None
            group, device = self.process_group, t.device
            # every rank takes part in the decision (a rank without a monitor says no there)
            willing = self.direct_nccl is True or (self.monitor or current_monitor()) is not None
            try:
                made = self._collective(
                    "making the direct NCCL communicator",
                    lambda: NcclComm.shared(group, device, willing),
                )
            except DistributedError:
                self._direct = False  # no second attempt: the other ranks may not make one
                raise
            self._direct = made if made is not None else False
            return made
        return direct  # type: ignore[return-value]

    def _coalesces(self, tensors: list[torch.Tensor]) -> bool:
        """Whether ``tensors`` can be all-reduced in place as one coalesced collective:
        contiguous, with NCCL, or on the CPU (Gloo's coalesced all-reduce takes CPU tensors
        only; Gloo with CUDA tensors takes the flat path)."""
        if not all(t.is_contiguous() for t in tensors):
            return False
        return self.backend == "nccl" or all(t.device.type == "cpu" for t in tensors)

    def _all_reduce_each(self, what: str, tensors: list[torch.Tensor]) -> Any:
        """Sum each of ``tensors`` (contiguous, one dtype) over the ranks, in place, in one
        coalesced collective (NCCL: one group of all-reduces, one launch; Gloo: flattened by
        the backend); returns what to ``wait()`` for."""
        group = self.process_group

        def run() -> Any:
            with _coalescing(group, async_ops=True) as coalesced:
                for t in tensors:
                    dist.all_reduce(t, group=group)
            return coalesced

        return self._collective(what, run)

    def _all_gather(self, what: str, values: torch.Tensor) -> torch.Tensor:
        """``(world_size, len(values))``: every rank's ``values``, in rank order (waited)."""
        out = values.new_empty(self.world_size * values.numel())
        group = self.process_group
        comm = self._comm(values) if values.is_contiguous() else None

        def run() -> None:
            if comm is not None:
                comm.all_gather_(out, values)
                return
            _gather(out, values, group=group, async_op=True).wait()

        self._collective(what, run)
        return out.view(self.world_size, values.numel())

    def __repr__(self) -> str:
        return (
            f"<DataParallel rank {self.rank}/{self.world_size}, buckets "
            f"{self.bucket_bytes / 2**20:g} MiB, check_every {self.check_every}>"
        )


def _compare(rows: torch.Tensor, names: list[str], step: int, rank: int) -> None:
    """Raise `DistributedError` unless every rank's checksums equal bit for bit."""
    bits = rows.view(torch.int64)
    groups: list[list[int]] = []
    for r in range(bits.shape[0]):
        for g in groups:
            if torch.equal(bits[g[0]], bits[r]):
                g.append(r)
                break
        else:
            groups.append([r])
    if len(groups) == 1:
        return
    reference = max(groups, key=lambda g: (len(g), 0 in g))
    diverging = sorted(r for g in groups if g is not reference for r in g)
    first = diverging[0]
    differs = (bits[first] != bits[reference[0]]).nonzero()
    tensor = int(differs[0, 0]) // 2 if len(differs) else 0
    which = names[tensor] if tensor < len(names) else "?"
    who = (
        f"rank {first} differs"
        if len(diverging) == 1
        else (f"ranks {', '.join(map(str, diverging))} differ")
    )
    raise DistributedError(
        f"[DataParallel] the weights diverged after step {step}: {who} from rank "
        f"{reference[0]} (first difference: "
        f"{which}; checked on rank {rank})"
    )
