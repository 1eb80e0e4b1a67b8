"""What the command-line tests share: running a command through click's CliRunner, the
``mpsnn check`` JSON report, and a fixture that runs a test module on one thread."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner, Result

import mpsnn.cli.trainer as trainer_module
from mpsnn.cli import main


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The checks run tiny tensors: thread hand-offs would cost more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def invoke_check(*args: str) -> Result:
    """``mpsnn check ARGS``."""
    return CliRunner().invoke(main, ["check", *args])


def check_report(*args: str) -> dict:
    """The JSON report of ``mpsnn check ARGS --json``, which must exit 0."""
    result = invoke_check(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def run_cli(*args: str) -> tuple[int, str]:
    """``mpsnn ARGS`` 200 columns wide (no line wrapping): the exit code and the output; an
    exception other than click's exit is raised."""
    result = CliRunner(env={"COLUMNS": "200"}).invoke(main, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the run gets as far as loading its data."""

    def refuse(*args: object) -> None:
        raise AssertionError("the mistake must be found before the data is loaded")

    monkeypatch.setattr(trainer_module, "load_dataset", refuse)
