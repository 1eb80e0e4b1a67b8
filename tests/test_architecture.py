"""The plan of the package: the forward → gradient registry is complete and symmetric, and
imports point down the layers (core → ops → cnn → ...) with no cycle."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import mpsnn as m
from mpsnn.core.binary import GradientKernel
from mpsnn.core.registry import forward_kernel_of, gradient_kernels_of, registered_pairs

ROOT = Path(m.__file__).resolve().parent

# Lower layers may be imported by higher ones, never the reverse.
LAYERS = [
    "errors", "core", "ops", "cnn", "optim", "graph", "distributed", "models", "data", "io", "cli",
]  # fmt: skip


def _public_classes() -> list[type]:
    return [v for v in vars(m).values() if inspect.isclass(v)]


def test_every_concrete_gradient_kernel_is_registered_both_ways() -> None:
    gradients = [
        c for c in _public_classes() if issubclass(c, GradientKernel) and c is not GradientKernel
    ]
    abstract = {m.ArithmeticGradient, m.PoolingGradient, m.UpsamplingGradient}
    for g in gradients:
        if g in abstract:
            assert forward_kernel_of(g) is None, f"{g.__name__} is a base, not registered"
            continue
        f = forward_kernel_of(g)
        assert f is not None, f"{g.__name__} names no forward kernel"
        assert g in gradient_kernels_of(f), f"{f.__name__} does not list {g.__name__}"
    for f, g in registered_pairs():
        assert forward_kernel_of(g) is f
        assert g._forward_class is f


def test_registry_answers_for_subclasses() -> None:
    class MyConvolution(m.Convolution):
        pass

    assert gradient_kernels_of(MyConvolution) == (m.ConvolutionGradient,)


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpsnn"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("mpsnn"))
    return out


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:  # the package itself: the public surface, above everything
        return len(LAYERS)
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else len(LAYERS)


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for path in ROOT.rglob("*.py"):
        mod = _module_name(path)
        for imp in _imports(path):
            if _layer(imp) > _layer(mod):
                wrong.append(f"{mod} imports {imp}")
    assert not wrong, "imports pointing up: " + "; ".join(sorted(wrong))


def test_no_import_cycles_between_modules() -> None:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        deps = set()
        for imp in _imports(path):
            # "from mpsnn.ops import triton" names a module; "from mpsnn.x import y" a module x
            target = imp if imp in modules else imp.rsplit(".", 1)[0]
            if target in modules and target != mod:
                deps.add(target)
        graph[mod] = deps
    # a package's __init__ re-exporting its modules is not a cycle of logic: ignore edges
    # from a package to its own submodules
    for mod in graph:
        graph[mod] = {d for d in graph[mod] if not d.startswith(mod + ".")}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                cycle.extend([*stack[stack.index(dep) :], dep] if dep in stack else [node, dep])
                return True
            if state.get(dep) is None and visit(dep, [*stack, dep]):
                return True
        state[node] = 2
        return False

    for mod in sorted(graph):
        if state.get(mod) is None and visit(mod, [mod]):
            break
    assert not cycle, "import cycle: " + " -> ".join(cycle)
