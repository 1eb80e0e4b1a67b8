"""``mpsnn predict CHECKPOINT FILES...``: the class a trained model gives each image file.

Reading an image (Pillow: PNG, JPEG and every format it reads; the first frame of an animated
one): it is converted to the model's channels with Pillow's ``Image.convert`` — ``"L"`` (luma
``0.299 R + 0.587 G + 0.114 B``, alpha dropped) for a 1-channel model, ``"RGB"`` for a
3-channel one — and must have the model's height and width: another size is refused, unless
``--resize``, which scales it to the model's size with bilinear filtering (the aspect ratio is
not kept). The bytes are then prepared as the run prepared its images (`mpsnn.cli.trained`)
and the inference graph gives the logits; the class is their argmax, the probability its
softmax value.
"""

from __future__ import annotations

import json
from pathlib import Path

import click
import torch

from mpsnn.cli.common import OneLineCommand, UserError
from mpsnn.data.imagefolder import _COLOUR, _GRAY

__all__ = ["predict", "read_image"]


@click.command(cls=OneLineCommand)
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--resize",
    is_flag=True,
    help="Scale images of another size to the model's (bilinear; the aspect ratio is not "
    "kept) instead of refusing them.",
)
@click.option(
    "--device",
    default=None,
    help="auto, cpu, cuda or cuda:N [default: the device the run trained on, where it is "
    "here; else auto].",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a JSON list of {file, class_index, class_name, probability}.",
)
def predict(
    checkpoint: Path, files: tuple[Path, ...], resize: bool, device: str | None, as_json: bool
) -> None:
    """The class of each image file (PNG, JPEG, ...) by a trained model. CHECKPOINT: a
    checkpoint.mpsnn written by mpsnn train, or the --checkpoint-dir holding it. Images are
    converted to the model's channels (grayscale or RGB) and must have its size (or
    --resize)."""
    from mpsnn.cli.trained import open_checkpoint

    run = open_checkpoint(checkpoint, device, read_data=False)
    images = torch.stack([read_image(f, run.input_shape, resize) for f in files])
    logits = run.logits(run.prepare(images)).double()
    probabilities = torch.softmax(logits, dim=1)
    best = probabilities.argmax(1).tolist()
    names = run.class_names
    rows = [
        {"file": str(f), "class_index": int(i), "class_name": names[i],
         "probability": float(probabilities[n, i])}
        for n, (f, i) in enumerate(zip(files, best, strict=True))
    ]  # fmt: skip
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo("file\tclass_index\tclass_name\tprobability")
    for r in rows:
        click.echo(f"{r['file']}\t{r['class_index']}\t{r['class_name']}\t{r['probability']:.4f}")


# the modes the dataset reader takes: 8-bit grayscale or colour
_MODES = frozenset(_GRAY | _COLOUR)


def read_image(path: Path, shape: tuple[int, int, int], resize: bool = False) -> torch.Tensor:
    """The image file ``path`` as ``(C, H, W)`` uint8 for a model of input ``shape`` (see the
    module docstring); a `UserError` for a file Pillow cannot read, a model of another channel
    count than 1 or 3, or another size without ``resize``."""
    try:
        from PIL import Image
    except ImportError:
        raise UserError("mpsnn predict reads images with Pillow: pip install pillow") from None
    channels, height, width = shape
    if channels not in (1, 3):
        raise UserError(
            f"mpsnn predict reads grayscale or RGB images: the model's input must have 1 or 3 "
            f"channels, got {channels}"
        )
    if path.exists() and not path.is_file():  # a FIFO would block, a device never end
        raise UserError(f"{path} must be an image file, got a directory or a special file")
    try:
        with Image.open(path) as img:
            img.seek(0)
            img.load()
            if img.mode not in _MODES:  # 16-bit or float pixels would be clamped to 8 bits
                raise UserError(
                    f"{path} must be an 8-bit grayscale or colour image (Pillow modes "
                    f"{', '.join(sorted(_MODES))}), got mode {img.mode}"
                )
            converted = img.convert("L" if channels == 1 else "RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise UserError(
            f"{path} must be an image file Pillow can read (PNG, JPEG, ...), got: {reason}"
        ) from None
    if converted.size != (width, height):
        if not resize:
            raise UserError(
                f"{path} must be a {width}x{height} image (width x height, the model's input), "
                f"got {converted.size[0]}x{converted.size[1]}; or scale it with --resize"
            )
        converted = converted.resize((width, height), Image.Resampling.BILINEAR)
    data = torch.frombuffer(bytearray(converted.tobytes()), dtype=torch.uint8)
    return data.view(height, width, channels).permute(2, 0, 1).contiguous()
