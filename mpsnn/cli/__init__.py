"""The ``mpsnn`` command: ``train``, ``bench``, ``check``, ``info``, ``export``, ``eval``,
``predict``.

Every user mistake (a bad flag value, a missing dataset, an impossible configuration) ends as
one clear line on stderr and exit status 2 (click's usage-error status); a traceback means a
bug in mpsnn.
"""

from __future__ import annotations

import click

__all__ = ["main"]


_COMMANDS = {
    "train": ("mpsnn.cli.train", "train"),
    "bench": ("mpsnn.cli.bench", "bench"),
    "check": ("mpsnn.cli.check", "check"),
    "info": ("mpsnn.cli.info", "info"),
    "export": ("mpsnn.cli.export", "export"),
    "eval": ("mpsnn.cli.evaluate", "evaluate"),
    "predict": ("mpsnn.cli.predict", "predict"),
}


class _Group(click.Group):
    """Commands are imported when used: ``mpsnn --help`` stays quick, and a broken optional
    dependency only affects its own command."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(_COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        import importlib

        where = _COMMANDS.get(name)
        if where is None:
            return None
        module, attr = where
        return getattr(importlib.import_module(module), attr)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mpsnn")
def main() -> None:
    """mpsnn: Apple's Metal Performance Shaders training system on CUDA GPUs and CPUs."""
    from mpsnn.cli.common import tune_cpu_allocator

    tune_cpu_allocator()
