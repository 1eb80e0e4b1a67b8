"""docs/models.md cannot rot: its ```python blocks (the import of a PyTorch ``state_dict``
into an mpsnn model, from memory and from exported files) run in order as one script on the
CPU, and their results are checked from the outside."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import torch

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_models_page_python_blocks_run_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "mkdtemp", lambda: str(tmp_path))  # the page's files: here
    blocks = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), flags=re.S | re.M)
    assert len(blocks) == 2, f"the page's runnable blocks changed: {len(blocks)}"
    namespace: dict[str, object] = {"__name__": "models_page"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/models.md, python block {i + 1}", "exec"), namespace)
    trained = namespace["trained"].state_dict()  # type: ignore[attr-defined]
    for name in ("model", "fresh"):  # the mpsnn models hold the PyTorch weights exactly
        mine = namespace[name].state_dict()  # type: ignore[attr-defined]
        assert list(mine) == list(trained)
        assert all(torch.equal(mine[k], trained[k]) for k in trained), name
    assert {p.name for p in tmp_path.iterdir()} == {"lenet.safetensors", "lenet.pt"}
    # and they are not the weights the models were built with
    assert not torch.equal(namespace["state"]["0.weight"], trained["0.weight"])  # type: ignore[index]
