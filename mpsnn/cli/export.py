"""``mpsnn export CHECKPOINT OUT``: a trained model's weights for PyTorch and ONNX.

The format is OUT's suffix:

* ``.pt``: the PyTorch twin's ``state_dict`` (``torch.save``; loads with
  ``torch.load(OUT, weights_only=True)`` and ``twin.load_state_dict``);
* ``.safetensors``: the same names and tensors, and the description below as metadata;
* ``.onnx``: the inference network, exported through the twin by ``torch.onnx.export``
  (input ``image``, ``(N, C, H, W)`` float32 with a free batch size; output ``logits``,
  ``(N, classes)``), the description as ``metadata_props``. Needs the ``onnx`` and
  ``onnxscript`` packages (not onnxruntime).

The twin is the checkpoint's model (``config.model``) built for the run's dataset (its image
shape and classes), holding the checkpoint's weights (`mpsnn.cli.trained`); the checkpoint
alone is read (the run's dataset only for a checkpoint of an older version). Files are written
atomically (a temporary file beside OUT, renamed onto it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import secrets
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import torch

from mpsnn.cli.common import OneLineCommand, UserError

__all__ = ["FORMATS", "describe", "export"]

#: OUT's suffix -> what it holds
FORMATS = {
    ".pt": "PyTorch state_dict",
    ".safetensors": "safetensors state_dict",
    ".onnx": "ONNX inference network",
}
_ONNX_PACKAGES = ("onnx", "onnxscript")


@click.command(cls=OneLineCommand)
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
def export(checkpoint: Path, out: Path) -> None:
    """Export a trained model to OUT: .pt (the PyTorch twin's state_dict), .safetensors (the
    same tensors) or .onnx (the inference network). CHECKPOINT: a checkpoint.mpsnn written by
    mpsnn train, or the --checkpoint-dir holding it."""
    from mpsnn.cli.trained import open_checkpoint

    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise UserError(f"OUT must end in {', '.join(FORMATS)} (the format), got {str(out)!r}")
    if suffix == ".onnx":
        absent = [p for p in _ONNX_PACKAGES if importlib.util.find_spec(p) is None]
        if absent:
            raise UserError(
                f"exporting to .onnx needs the package{'s' * (len(absent) > 1)} "
                f"{' and '.join(absent)}: pip install {' '.join(absent)}"
            )
    if out.is_dir():
        raise UserError(f"OUT must be a file to write, got the directory {out}")
    run = open_checkpoint(checkpoint, "cpu", read_data=False)
    meta = describe(run)
    twin = run.model.torch_module().eval()
    write = {".pt": _write_pt, ".safetensors": _write_safetensors, ".onnx": _write_onnx}[suffix]
    write(twin, out, meta, run.input_shape)
    mean, std = run.normalization
    click.echo(
        f"exported {run.config.model} (epoch {run.epoch}, {run.model.parameter_count():,} "
        f"parameters) to {out} ({FORMATS[suffix]}); input (N, "
        f"{', '.join(map(str, run.input_shape))}) float32 = (pixel / 255 - {mean:.6g}) / "
        f"{std:.6g}; {run.classes} classes"
    )


def describe(run: Any) -> dict[str, str]:
    """What a user of the exported weights needs besides them, as strings (the metadata of
    .safetensors and .onnx files): ``model``, ``dataset``, ``epoch``, ``input_shape`` (JSON
    ``[C, H, W]``), ``mean`` and ``std`` (the input is ``(pixel / 255 - mean) / std``),
    ``class_names`` (a JSON list)."""
    mean, std = run.normalization
    return {
        "model": run.config.model,
        "dataset": str(run.config.dataset),
        "epoch": str(run.epoch),
        "input_shape": json.dumps(list(run.input_shape)),
        "mean": repr(mean),
        "std": repr(std),
        "class_names": json.dumps(run.class_names),
    }


# what torch.save and safetensors raise for a failed write (not OSError: a C++ enforce or a
# Rust error): turned into one Error line
_WRITE_ERRORS = frozenset({"RuntimeError", "SafetensorError"})


@contextlib.contextmanager
def _atomically(out: Path) -> Iterator[Path]:
    """A temporary path beside ``out``, renamed onto it when the block succeeds (removed when
    it raises); a failed write is a `UserError` naming ``out``."""
    tmp: Path | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        while tmp is None:  # created with the umask's permissions (mkstemp's are 0600)
            name = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
            with contextlib.suppress(FileExistsError):
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                tmp = name
        yield tmp
        os.replace(tmp, out)
        tmp = None
    except OSError as exc:
        raise UserError(f"writing {out} failed: {exc.strerror or exc}") from None
    except Exception as exc:  # the writers' own errors (torch.save, safetensors): a full disk
        if isinstance(exc, UserError) or type(exc).__name__ not in _WRITE_ERRORS:
            raise
        raise UserError(f"writing {out} failed: {exc}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _state(twin: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in twin.state_dict().items()}


def _write_pt(twin: torch.nn.Module, out: Path, meta: dict[str, str], shape: Any) -> None:
    with _atomically(out) as tmp:
        torch.save(_state(twin), tmp)


def _write_safetensors(twin: torch.nn.Module, out: Path, meta: dict[str, str],
                       shape: Any) -> None:  # fmt: skip
    from safetensors.torch import save_file

    with _atomically(out) as tmp:
        save_file(_state(twin), str(tmp), metadata={"format": "pt", **meta})


def _write_onnx(twin: torch.nn.Module, out: Path, meta: dict[str, str], shape: Any) -> None:
    import onnx

    example = torch.zeros(2, *shape)
    with _atomically(out) as tmp:
        _quietly(lambda: torch.onnx.export(
            twin, (example,), str(tmp), dynamo=True, external_data=False,
            input_names=["image"], output_names=["logits"],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
        ))  # fmt: skip
        proto = onnx.load(str(tmp))
        proto.doc_string = (
            f"mpsnn {meta['model']} trained on {meta['dataset']} ({meta['epoch']} epochs); "
            "input: (pixel / 255 - mean) / std"
        )
        for key, value in meta.items():
            entry = proto.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.save(proto, str(tmp))


def _quietly(call: Callable[[], Any]) -> Any:
    """Run the ONNX exporter without its progress lines (stdout), warnings and log records:
    the command prints its own summary."""
    import logging

    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return call()
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
