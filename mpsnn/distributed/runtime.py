"""Joining a data-parallel run: `init_distributed` reads the environment a launcher set
(``torchrun``, or ``mpsnn train --nproc``), picks the device and backend, joins the process
group and starts the rank's `RankMonitor`; `DistributedRun` is what a training loop needs
afterwards (rank, world size, device, a checked all-reduce, a clean or failed end).

Environment (torchrun's names): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``. ``mpsnn train --nproc`` also sets ``MPSNN_LAUNCHER=1``: its parent process
hosts the rendezvous store, so every rank joins it as a client (the store outlives any rank).
Under torchrun the process group is made from ``env://``.

Devices: with CUDA (``device`` ``auto`` or ``cuda``) rank ``r`` uses ``cuda:LOCAL_RANK`` and
NCCL; on the CPU (``device`` ``cpu``, or no GPU) Gloo, the ``LOCAL_WORLD_SIZE`` ranks of a
machine sharing its cores (``torch.set_num_threads(cores // ranks)`` unless
``OMP_NUM_THREADS`` is set). The process group's own timeout is
``timeout + max(10, timeout / 2)``: the monitor (``timeout``) ends a stuck run first, with a
message that names the rank; the backend's timeout is the backstop.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mpsnn.core.device import Device
from mpsnn.distributed.monitor import RankMonitor
from mpsnn.distributed.nccl import close_all
from mpsnn.errors import DistributedError

__all__ = [
    "DistributedRun",
    "current_monitor",
    "environment_world_size",
    "init_distributed",
    "monitor_store",
]

_CURRENT: RankMonitor | None = None


def current_monitor() -> RankMonitor | None:
    """The monitor `init_distributed` started in this process (None when none runs)."""
    return _CURRENT


def environment_world_size() -> int:
    """``WORLD_SIZE`` from the environment (1 when unset): > 1 inside a launched rank."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass
class DistributedRun:
    """One rank of a data-parallel run (made by `init_distributed`).

    Attributes:
        rank, world_size, local_rank: this process's place in the run.
        device: the mpsnn `Device` of this rank (``cuda:local_rank``, or the CPU).
        backend: ``"nccl"`` or ``"gloo"``.
        monitor: the rank's heartbeat monitor.
        group: the process group (None: the default group).
    """

    rank: int
    world_size: int
    local_rank: int
    device: Device
    backend: str
    monitor: RankMonitor
    group: Any = None
    _closed: bool = field(default=False, repr=False)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, writes metrics, plots and checkpoints."""
        return self.rank == 0

    def all_reduce_sum(self, tensor: torch.Tensor, what: str = "an all-reduce") -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (on its device); a failure raises
        `DistributedError` naming the rank that caused it where the heartbeats tell."""
        try:
            dist.all_reduce(tensor, group=self.group)
        except Exception as exc:
            raise DistributedError(
                f"[DistributedRun] {what} failed on rank {self.rank}: {self.monitor.diagnose()}"
            ) from exc
        return tensor

    def barrier(self, what: str = "a barrier") -> None:
        """Wait for every rank (through a one-element all-reduce on this rank's device)."""
        self.all_reduce_sum(torch.zeros(1, device=self.device.torch_device), what)

    def fail(self, message: str) -> None:
        """This rank failed: tell the others (they end within two heartbeats, naming it),
        stop the monitor. The process group is left alone: destroying it may wait for ranks
        that are gone."""
        if not self._closed:
            self._closed = True
            self.monitor.report_failure(message)
            self.monitor.stop()
            _forget(self.monitor)

    def close(self) -> None:
        """A normal end: wait for every rank, stop the monitor, leave the process group."""
        if self._closed:
            return
        self.barrier("the final barrier")
        self._closed = True
        self.monitor.stop()
        _forget(self.monitor)
        close_all()  # the direct NCCL communicators (`mpsnn.distributed.nccl`)
        if dist.is_initialized():
            dist.destroy_process_group()


def _forget(monitor: RankMonitor) -> None:
    global _CURRENT
    if _CURRENT is monitor:
        _CURRENT = None


def init_distributed(device: str = "auto", timeout: float = 300.0) -> DistributedRun | None:
    """Join the run the environment describes (see the module docstring); None when this
    process was not launched as one of several ranks (``WORLD_SIZE`` unset or 1).

    Args:
        device: ``auto`` (CUDA when available), ``cuda`` or ``cpu``. A single GPU
            (``cuda:N``) cannot serve several ranks: rank ``r`` takes ``cuda:LOCAL_RANK``.
        timeout: seconds after which a dead or hung rank ends the run (`RankMonitor`).

    Raises:
        ValueError: a bad ``device`` or environment.
        DistributedError: the process group could not be joined in time.
    """
    global _CURRENT
    world = environment_world_size()
    if world <= 1:
        return None
    try:
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        host = os.environ["MASTER_ADDR"]
        port = int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        raise ValueError(
            "[init_distributed] a launched rank needs RANK, WORLD_SIZE, MASTER_ADDR and "
            f"MASTER_PORT in its environment (torchrun or mpsnn train --nproc set them), got "
            f"{exc!r}"
        ) from None
    if not timeout > 0:
        raise ValueError(f"[init_distributed] timeout must be > 0 seconds, got {timeout}")
    mpsnn_device, backend = _device(device, local_rank)
    pg_timeout = datetime.timedelta(seconds=timeout + max(10.0, timeout / 2))
    store_timeout = datetime.timedelta(seconds=timeout)
    kwargs: dict[str, Any] = {"backend": backend, "rank": rank, "world_size": world,
                              "timeout": pg_timeout}  # fmt: skip
    if backend == "nccl":
        kwargs["device_id"] = mpsnn_device.torch_device
    try:
        if os.environ.get("MPSNN_LAUNCHER") == "1":
            store = dist.TCPStore(host, port, is_master=False, timeout=store_timeout)
            dist.init_process_group(store=dist.PrefixStore("pg/", store), **kwargs)
        else:
            dist.init_process_group(init_method="env://", **kwargs)
        client = _monitor_client(host, port, store_timeout)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DistributedError(
            f"[init_distributed] rank {rank} could not join the {world} ranks at "
            f"{host}:{port} within {timeout:g} s (did every rank start?): {first}"[:500]
        ) from exc
    monitor = RankMonitor(monitor_store(client), rank, world, timeout,
                          store_address=f"{host}:{port}").start()  # fmt: skip
    _CURRENT = monitor
    return DistributedRun(rank, world, local_rank, mpsnn_device, backend, monitor)


def monitor_store(client: Any) -> Any:
    """The monitors' keys in the rendezvous store ``client``: one namespace per run and restart
    (torchrun's ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``; ``local/0`` for
    ``mpsnn train --nproc``)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"mpsnn/monitor/{run_id}/{attempt}/", client)


def _monitor_client(host: str, port: int, timeout: datetime.timedelta) -> Any:
    """The monitor's own connection to the rendezvous store (its thread is its only user); the
    process group's store when no second connection can be made."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timeout)
    except Exception:
        return dist.distributed_c10d._get_default_store()


def _device(name: str, local_rank: int) -> tuple[Device, str]:
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        _share_cores()
        return Device("cpu"), "gloo"
    if name in ("auto", "cuda"):
        if torch.cuda.is_available():
            if local_rank >= torch.cuda.device_count():
                raise ValueError(
                    f"[init_distributed] local rank {local_rank} needs cuda:{local_rank}, got "
                    f"{torch.cuda.device_count()} GPUs on this machine"
                )
            torch.cuda.set_device(local_rank)
            return Device(f"cuda:{local_rank}"), "nccl"
        raise ValueError("[init_distributed] device cuda needs a GPU, got none here")
    raise ValueError(
        f"[init_distributed] device must be auto, cuda or cpu (rank r uses cuda:LOCAL_RANK), "
        f"got {name!r}"
    )


def _share_cores() -> None:
    """CPU ranks of one machine split its cores (unless OMP_NUM_THREADS says otherwise):
    N ranks each running as many threads as there are cores would oversubscribe them."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
