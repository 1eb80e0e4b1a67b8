"""``mpsnn train`` as a data-parallel run: the ``--nproc`` parent (checks, then starts the
ranks with `mpsnn.launch_local`), and each rank's join and end (``--nproc`` children and
``torchrun -m mpsnn train`` workers alike).

A rank prints only from rank 0, except for a failure: a rank whose run cannot go on prints
one line (``Error: [rank r] ...``, naming the rank that died or hung where the heartbeats
tell), reports it in the rendezvous store and exits with status 1 (2 for a user error, which
only rank 0 prints). See ``docs/distributed.md``.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from mpsnn.cli.common import UserError
from mpsnn.distributed import DistributedRun, init_distributed, launch_local
from mpsnn.distributed.monitor import say
from mpsnn.distributed.runtime import environment_world_size
from mpsnn.errors import DistributedError

__all__ = ["in_launched_rank", "launch_ranks", "run_rank"]

#: options of the parent that the ranks do not take again
_PARENT_ONLY = ("nproc",)


def in_launched_rank() -> bool:
    """Whether this process is one of several ranks (``WORLD_SIZE`` > 1)."""
    return environment_world_size() > 1


def launch_ranks(ctx: click.Context, opts: dict[str, Any]) -> int:
    """The ``--nproc N`` parent: check what would make every rank fail, then run ``N`` ranks
    of ``python -m mpsnn train`` with the same options; returns the exit status."""
    nproc = opts["nproc"]
    _check_common(opts, nproc)
    if opts["resume"]:
        batch = _saved_batch_size(opts["checkpoint_dir"], opts["batch_size"])
    else:
        batch = opts["batch_size"]
    _check_batch(batch, nproc)
    device = opts["device"]
    if device in ("auto", "cuda"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device == "cuda" and gpus == 0:
            raise UserError("--device cuda needs a GPU, got none here (use --device cpu)")
        if gpus and nproc > gpus:
            raise UserError(
                f"--nproc {nproc} needs one GPU per rank, got {gpus} GPUs (use --device cpu "
                "for CPU ranks)"
            )
    command = [sys.executable, "-m", "mpsnn", "train", *_arguments(ctx)]
    return launch_local(nproc, command, timeout=opts["timeout"], label="mpsnn train")


def _check_common(opts: dict[str, Any], world: int) -> None:
    if opts["compare_torch"]:
        raise UserError(
            f"--compare-torch trains one PyTorch process; not with {world} ranks (drop it or "
            "run on one process)"
        )
    device = opts["device"]
    if device not in ("auto", "cuda", "cpu"):
        raise UserError(
            f"--device must be auto, cuda or cpu with several ranks (rank r uses "
            f"cuda:LOCAL_RANK), got {device!r}"
        )


def _check_batch(batch: int, world: int) -> None:
    if batch % world:
        raise UserError(
            f"--batch-size {batch} (the global batch) must be divisible by the {world} ranks: "
            "each rank trains on batch-size / ranks images"
        )


def _saved_batch_size(folder: Path | None, fresh: int) -> int:
    """The global batch of the checkpoint a resumed run continues (read on the CPU), or
    ``fresh`` when the folder holds no checkpoint (``--resume`` then starts a fresh run)."""
    from mpsnn.cli.runs import CHECKPOINT, check_checkpoint
    from mpsnn.cli.trainer import _FIELDS
    from mpsnn.core.device import Device
    from mpsnn.errors import CheckpointError
    from mpsnn.io import load

    if folder is None:
        raise UserError("--resume needs --checkpoint-dir (where the checkpoint is)")
    path = folder / CHECKPOINT
    if not path.exists():
        return fresh
    try:
        ckpt = load(path, Device("cpu"))
    except CheckpointError as exc:
        raise UserError(f"{path} is not a usable checkpoint: {exc}") from None
    check_checkpoint(ckpt, path, _FIELDS)
    return int(ckpt["config"]["batch_size"])


def _arguments(ctx: click.Context) -> list[str]:
    """The command line of a rank: every option of this call but the parent's own."""
    out: list[str] = []
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in _PARENT_ONLY:
            continue
        value = ctx.params.get(param.name or "")
        if value is None:
            continue
        flag = max(param.opts, key=len)
        if param.is_flag:
            if value:
                out.append(flag)
            continue
        out += [flag, str(value)]
    return out


def join_run(opts: dict[str, Any]) -> DistributedRun:
    """Join the run the environment describes (a launched rank); user mistakes that every
    rank would make are refused before joining (printed by rank 0 only)."""
    world = environment_world_size()
    try:
        _check_common(opts, world)
        if not opts["resume"]:
            _check_batch(opts["batch_size"], world)
    except UserError as exc:
        _user_error(exc)
    try:
        run = init_distributed(opts["device"], opts["timeout"])
    except ValueError as exc:
        _user_error(UserError(str(exc).removeprefix("[init_distributed] ")))
    except DistributedError as exc:
        _end(f"Error: {exc}", 1)
    assert run is not None
    return run


def run_rank(run: DistributedRun, body: Callable[[], None]) -> None:
    """Run ``body`` as this rank; end every rank cleanly, or this one with one line."""
    try:
        body()
    except BaseException as exc:
        run.monitor.claim_end()  # this rank's own line, not a second one from its monitor
        _failed(run, exc)
    else:
        try:
            run.close()
        except DistributedError as exc:
            run.monitor.claim_end()
            _end(f"Error: [rank {run.rank}] {exc}", 1)


def _failed(run: DistributedRun, exc: BaseException) -> None:
    """End the rank after ``exc``: its line, then the others are told (bounded wait)."""
    if isinstance(exc, UserError):
        run.fail(exc.format_message())
        _user_error(exc, run.rank)
    elif isinstance(exc, DistributedError):
        message = f"[rank {run.rank}] {exc}"
        _say(f"Error: {message}")  # first: telling the others waits for the store
        run.fail(message)
        _end("", 1)
    elif isinstance(exc, (KeyboardInterrupt, click.exceptions.Exit, click.exceptions.Abort)):
        run.fail(f"rank {run.rank} was interrupted")
        _end("", 130)
    else:  # a bug: the traceback, and the others are told
        run.fail(f"{type(exc).__name__}: {exc}")
        traceback.print_exception(exc)
        _end("", 1)


def _user_error(exc: UserError, rank: int | None = None) -> None:
    """Rank 0 shows a user error (one line, status 2); the others end quietly with 2."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    if rank == 0:
        sys.stdout.flush()
        exc.show()
    _end("", 2)


def _say(line: str) -> None:
    """Print ``line`` to stderr as one line (after what stdout holds, in one write: the
    ranks' lines must not interleave)."""
    say(" ".join(line.split()))


def _end(line: str, code: int) -> None:
    """Print ``line`` to stderr and end the process now: an orderly interpreter exit could
    wait on collectives that will never complete."""
    if line:
        _say(line)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
