"""The type checker's verdict on the typed layers of the library, `mpsnn.core` and `mpsnn.ops`:
no error. Its settings are pyproject.toml's ``[tool.mypy]``; its incremental cache lives in
.mypy_cache (a warm run takes about a second, a cold one under a minute)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")  # `scripts/setup.sh --dev` installs it, so CI runs this

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_error_in_core_and_ops() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "mpsnn/core", "mpsnn/ops"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
