"""docs/porting.md cannot rot: its ```python blocks run in order, as one script in one namespace,
on the CPU (the guide's convention: ```objc and ```text blocks are illustrative and not run),
and every `m.<name>` / `mpsnn.<name>` the page cites exists in the package."""

from __future__ import annotations

import contextlib
import inspect
import re
from pathlib import Path

import numpy as np
import torch

import mpsnn

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "porting.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", GUIDE.read_text(), flags=re.S | re.M)


def test_porting_guide_python_blocks_run_in_order_on_the_cpu() -> None:
    blocks = _blocks("python")
    assert len(blocks) >= 15, f"the guide lost its runnable blocks: {len(blocks)} left"
    assert all("Device(\"cuda\")" not in b and "Device.default()" not in b.split("#")[0]
               for b in blocks), "runnable blocks must stay on the CPU"  # fmt: skip
    namespace: dict[str, object] = {"__name__": "porting_guide"}
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"docs/porting.md, python block {i + 1}", "exec"), namespace)
    finally:
        mpsnn.set_float32_matmul_precision("highest")  # whatever a failing block left
    # what the guide's loop claims, checked from the outside
    sources = namespace["sources"]
    steps = namespace["steps"]
    assert [s.adam.time_step for s in sources] == [1 + steps] * 4  # type: ignore[attr-defined]
    losses = namespace["losses"]
    assert len(losses) == steps and all(np.isfinite(losses))  # type: ignore[arg-type]
    # the data sources' own tensors are the memory Adam wrote: the inference graph reloaded them
    first = sources[0]  # type: ignore[index]
    assert first._state.weights.data_ptr() == first.weights().data_ptr()
    assert not torch.equal(
        first.weights(),
        (torch.rand(first.weights().shape, generator=torch.Generator().manual_seed(0)) * 0.4) - 0.2,
    )
    assert all(s.read_count == 0 for s in namespace["KeepsGradients"].kept)  # type: ignore[attr-defined]
    assert mpsnn.get_float32_matmul_precision() == "highest"


def _public_attributes() -> set[str]:
    """Every attribute, parameter and enum member name of mpsnn's public classes, and every
    public attribute its code assigns on ``self`` (node and kernel properties set in
    ``__init__``)."""
    names: set[str] = set()
    for obj in (getattr(mpsnn, n) for n in mpsnn.__all__):
        if not inspect.isclass(obj):
            continue
        names |= set(dir(obj))
        for fn in [obj, *(getattr(obj, a, None) for a in dir(obj))]:
            if callable(fn):
                with contextlib.suppress(TypeError, ValueError):
                    names |= set(inspect.signature(fn).parameters)
    for path in Path(mpsnn.__file__).parent.rglob("*.py"):
        names |= set(re.findall(r"\bself\.([a-z][a-z0-9_]*)\s*(?::[^=]+)?=", path.read_text()))
    return names


def test_porting_guide_cites_only_names_that_exist() -> None:
    """`m.X` / `mpsnn.X` anywhere, and the prose's backticked mpsnn names (`Class`,
    `Class.attribute`, `variable.method()`, snake_case methods, properties and parameters,
    enum members) exist. MPS names (prefixed, camelCase or selectors) are not checked."""
    text = GUIDE.read_text()
    cited = set(re.findall(r"\bm\.([A-Za-z_][A-Za-z0-9_]*)", text))
    cited |= set(re.findall(r"\bmpsnn\.([A-Za-z_][A-Za-z0-9_]*)", text))
    cited -= {"py"}  # file names: examples/apple_mnist.py
    missing = sorted(n for n in cited if not hasattr(mpsnn, n))
    assert not missing, f"docs/porting.md cites names mpsnn does not have: {missing}"
    assert len(cited) > 40
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)  # code blocks
    prose = re.sub(r"````.*?````", "", prose)  # spans quoting fences
    attributes = _public_attributes()
    tensor_methods = set(dir(torch.Tensor))
    checked, wrong = 0, []
    for quoted in re.findall(r"`([^`\n]+)`", prose):
        found = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(?:\.([A-Za-z_][A-Za-z0-9_]*))?", quoted)
        if found is None or "/" in quoted or ":" in quoted or quoted.endswith(" "):
            continue  # paths, fence names, Objective-C selectors
        head, attr = found.groups()
        if re.match(r"(MPS|MTL|NS|F$|torch$|np$)", head) or re.search(r"^[a-z]+[A-Z]", head):
            continue  # MPS, Metal, Foundation and PyTorch names, camelCase MPS properties
        checked += 1
        if head in mpsnn.__all__:  # a public name, maybe with an attribute
            if attr and not hasattr(getattr(mpsnn, head), attr):
                wrong.append(quoted)
        elif attr is not None:  # variable.attribute: the attribute (or a tensor method)
            if attr not in attributes and attr not in tensor_methods:
                wrong.append(quoted)
        elif head not in attributes:  # a method, property, parameter or enum member
            wrong.append(quoted)
    assert not wrong, f"docs/porting.md names what mpsnn does not have: {wrong}"
    assert checked > 80


def test_porting_guide_keeps_objective_c_beside_python() -> None:
    """Each part of the sample is shown in both languages."""
    assert len(_blocks("objc")) >= 8
    for heading in (
        "Images and labels from bytes",
        "The data source",
        "Optimizers",
        "Nodes and the training graph",
        "Completion handlers and two steps in flight",
        "Read counts",
        "Inference",
        "Memory layout",
    ):
        assert re.search(rf"^## {re.escape(heading)}", GUIDE.read_text(), flags=re.M), heading
