"""``mpsnn info``: versions, devices, cuDNN, the Triton fast paths and the Fashion-MNIST data."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from typing import Any

import click

__all__ = ["collect", "info"]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _triton_version() -> str | None:
    try:
        import triton
    except Exception:  # not installed, or broken: either way not usable
        return None
    return str(getattr(triton, "__version__", None) or _version("triton"))


def collect() -> dict[str, Any]:
    """Everything ``mpsnn info`` reports, as plain data."""
    import numpy
    import torch

    from mpsnn.ops import triton as fast_paths

    versions = {
        "mpsnn": _version("mpsnn"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "numpy": numpy.__version__,
        "safetensors": _version("safetensors"),
    }
    cuda = torch.cuda.is_available()
    devices = []
    for i in range(torch.cuda.device_count() if cuda else 0):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "compute_capability": f"{p.major}.{p.minor}",
            }
        )
    cudnn = torch.backends.cudnn.is_available()
    triton_ok, enabled = fast_paths.available(), fast_paths.enabled()
    active = cuda and triton_ok and enabled
    if active:
        why = "CUDA tensors in float16, bfloat16 and float32 use them where they apply"
    elif not triton_ok:
        why = "Triton is not importable (pip install 'triton>=3.0')"
    elif not enabled:
        why = "turned off (mpsnn.ops.triton.set_enabled(False))"
    else:
        why = "no CUDA device: every kernel runs its portable PyTorch path"
    try:
        from mpsnn.data.fashion_mnist import find_fashion_mnist

        data = {"found": True, "path": str(find_fashion_mnist()), "hint": None}
    except FileNotFoundError:
        hint = (
            "not found; install it with `sudo apt-get install dataset-fashion-mnist` "
            "(scripts/setup.sh does), or put the four idx files in $MPSNN_DATA/fashion-mnist"
        )
        data = {"found": False, "path": None, "hint": hint}
    return {
        "versions": versions,
        "cpu": {"threads": torch.get_num_threads(), "cores": os.cpu_count()},
        "cuda": {"available": cuda, "version": torch.version.cuda, "devices": devices},
        "cudnn": {
            "available": cudnn,
            "version": torch.backends.cudnn.version() if cudnn else None,
        },
        "triton_fast_paths": {"active": active, "reason": why},
        "fashion_mnist": data,
    }


@click.command("info")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def info(as_json: bool) -> None:
    """Versions, devices, cuDNN, whether the Triton fast paths run, where the data is."""
    report = collect()
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="mpsnn info", title_justify="left", show_header=False)
    table.add_column(style="cyan", no_wrap=True)
    table.add_column()
    for name, version in report["versions"].items():
        table.add_row(name, version or "not installed")
    cpu = report["cpu"]
    table.add_row("CPU", f"{cpu['threads']} torch threads, {cpu['cores']} cores", end_section=True)
    cuda = report["cuda"]
    if not cuda["devices"]:
        table.add_row("CUDA devices", "none")
    for d in cuda["devices"]:
        table.add_row(
            f"cuda:{d['index']}",
            f"{d['name']}, {d['memory_gib']} GiB, compute capability {d['compute_capability']}",
        )
    cudnn = report["cudnn"]
    table.add_row("cuDNN", f"version {cudnn['version']}" if cudnn["available"] else "not available")
    fast = report["triton_fast_paths"]
    table.add_row(
        "Triton fast paths", Text(("active: " if fast["active"] else "inactive: ") + fast["reason"])
    )
    data = report["fashion_mnist"]
    table.add_row("Fashion-MNIST", Text(data["path"] if data["found"] else data["hint"]))
    Console(highlight=False).print(table)
